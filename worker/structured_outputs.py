"""StructuredOutputsParams: the one constraint a request puts on its output (vLLM's names).

Exactly one of ``json`` (a JSON schema, as a dict or a JSON string), ``regex``, ``choice``
(a list of strings), ``grammar`` (EBNF/GBNF when it contains ``::=``, else Lark) or
``json_object`` (any JSON object) is set. Shape checks run here, with no model; compiling
against a tokenizer happens before admission (``worker.validation.RequestValidator``), which
attaches the compiled grammar here. That compiled grammar never crosses a process: pickling drops
it, and the receiving worker compiles (or finds in its cache) its own.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field, fields
from typing import Any

KINDS: tuple[str, ...] = ("json", "regex", "choice", "grammar", "json_object")

# The largest constraint a request may give, as its canonical ``spec`` in UTF-8 bytes: compile
# cost grows with it (issue 17: a 600 KB grammar took 5 GB and 15 minutes to compile). The
# engine's compiler enforces it; the ingress checks ``limits.max_constraint_bytes`` (default: this).
MAX_CONSTRAINT_BYTES = 64 << 10


def _bad(field_name: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{field_name}: {rule}, got {value!r}"[:500])


@dataclass
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Set before admission by the request validator; never pickled, never compared.
    compiled: Any = field(default=None, repr=False, compare=False)
    # Where the constraint came from, for error messages (e.g. "response_format.json_schema").
    source: str = field(default="structured_outputs", repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, (str, bytes)):
            self.choice = list(self.choice)
        if self.json_object is False:
            self.json_object = None
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)}, got {given or 'none'}")
        self._check(given[0])

    def _check(self, kind: str) -> None:
        value = getattr(self, kind)
        where = self.field_name
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = _json.loads(value)
                except ValueError as exc:
                    raise _bad(where, value, f"not valid JSON ({exc})") from exc
            else:
                parsed = value
            if not isinstance(parsed, dict):
                raise _bad(where, value, "must be a JSON schema (an object)")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value.strip():
                raise _bad(where, value, "must be a non-empty string")
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise _bad(where, value, "must be a non-empty list of non-empty strings")
        elif value is not True:
            raise _bad(where, value, "must be true")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``KINDS``."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def field_name(self) -> str:
        """The request field that holds the constraint, as error messages name it."""
        return f"{self.source}.{self.kind}" if self.source == "structured_outputs" else self.source

    @property
    def spec(self) -> str:
        """The constraint as a canonical string (the compile cache's key, with ``kind``)."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            if isinstance(value, str):
                value = _json.loads(value)
            # Key order is kept: xgrammar emits properties in schema order, so it is meaning.
            return _json.dumps(value, separators=(",", ":"))
        if self.kind == "choice":
            return _json.dumps(value)
        return "" if self.kind == "json_object" else str(value)

    @classmethod
    def from_dict(cls, value: Any, name: str = "structured_outputs") -> StructuredOutputsParams:
        """From a wire/JSON object; an unknown key is an error naming it (nothing is ignored)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{name}: must be an object with one of {', '.join(KINDS)}, got {value!r}")
        known = {f.name for f in fields(cls)} - {"compiled", "source"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{name}: {', '.join(unknown)} not supported (supported: {', '.join(KINDS)})")
        return cls(**{k: v for k, v in value.items() if v is not None}, source=name)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["compiled"] = None
        return state

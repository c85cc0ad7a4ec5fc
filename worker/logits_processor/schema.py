"""The ``extra_args`` keys a processor owns: declaring them, validating them, publishing them.

A processor declares its keys in one of three ways (first match wins):

- ``extra_args_model``: a pydantic model whose fields (by alias) are the keys it owns. The
  default ``validate_params`` validates those keys of ``params.extra_args`` against it, and
  ``parse_extra_args`` gives the processor the typed values. Its JSON schema is published.
- ``extra_args_schema``: a JSON schema dict (the older form); its ``properties`` are the keys.
  Published as is; validation stays in the processor's own ``validate_params``.
- ``extra_args_keys``: a tuple of key names, no schema (``()`` = reads no ``extra_args``).

A processor that declares none of these could read any key: while one is loaded, the loaded
set cannot tell a misspelt key from one that processor reads, so strict key checking is off
(see ``registry.LogitsProcessors.validate_params``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

from worker.sampling_params import SamplingParams


class ExtraArgs(BaseModel):
    """Base for ``extra_args_model``: JSON types kept exactly (no "1.5" -> 1.5), other keys ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, populate_by_name=False)


def _model(cls: type) -> type[BaseModel] | None:
    model = getattr(cls, "extra_args_model", None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def declared_keys(cls: type) -> frozenset[str] | None:
    """The ``extra_args`` keys ``cls`` owns, or None when it declares nothing (it may read any)."""
    model = _model(cls)
    if model is not None:
        return frozenset(f.alias or name for name, f in model.model_fields.items())
    schema = getattr(cls, "extra_args_schema", None)
    if isinstance(schema, dict):
        return frozenset(schema.get("properties", {}))
    keys = getattr(cls, "extra_args_keys", None)
    return None if keys is None else frozenset(keys)


def json_schema(cls: type) -> dict[str, Any] | None:
    """The published JSON schema of ``cls``'s keys (from its model, else its dict), or None."""
    model = _model(cls)
    if model is not None:
        return model.model_json_schema(by_alias=True)
    schema = getattr(cls, "extra_args_schema", None)
    return schema if isinstance(schema, dict) else None


def parse_extra_args(cls: type, params: SamplingParams) -> BaseModel | None:
    """``cls.extra_args_model`` built from the request's keys it owns; None when none is present.

    Raises ValueError naming the key, e.g. ``extra_args.xtc_threshold: Input should be ...``.
    """
    model = _model(cls)
    extra = params.extra_args
    if model is None or not extra:
        return None
    owned = declared_keys(cls) or frozenset()
    given = {k: v for k, v in extra.items() if k in owned}
    if not given:
        return None
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        raise ValueError("; ".join(_message(e) for e in exc.errors(include_url=False))) from None


def _message(err: ErrorDetails) -> str:
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"extra_args.{where}: {err.get('msg', 'invalid')}" if where else f"extra_args: {err.get('msg', 'invalid')}"

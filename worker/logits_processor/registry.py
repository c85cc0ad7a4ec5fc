"""Loading the worker's logits processors at start-up (docs/sampling.md "Programming model") and the loaded set.

Order is the pipeline order: the built-ins (AllowedTokenIds, BadWords, MinTokens, LogitBias,
StructuredOutputs, MinP: docs/sampling.md "The nine steps" steps 3-5, 7b), then every entry point of
group ``logitpool.logits_processors`` sorted by name, then the configured ``custom`` ones (FQCN
strings or classes) in order. A class listed twice loads once, at its first position. Penalties
are loaded too but kept apart: the sampler applies them at step 6, not through the generic lists.

Declaring ``extra_args`` (``schema.py``): a processor may own keys of ``SamplingParams.extra_args``
through a pydantic ``extra_args_model``, a JSON-schema dict ``extra_args_schema`` or bare
``extra_args_keys``. ``describe()`` publishes each processor's keys, JSON schema and argmax
invariance.

Strict keys: when every loaded processor declares its keys, a request key that none of them
owns is a ValueError listing the known keys (a misspelt key is never silently ignored). A
loaded processor that declares nothing could read any key, so strict checking is off while one
is loaded; the config's ``strict_extra_args = False`` turns it off always.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points as _installed_entry_points
from typing import Any, TypeVar

import torch

from worker.logits_processor.builtin import (
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from worker.logits_processor.errors import LogitsProcessorLoadError, ProcessorError
from worker.logits_processor.interface import BatchUpdate, LogitsProcessor
from worker.logits_processor.penalties import PenaltiesLogitsProcessor
from worker.logits_processor.schema import declared_keys, json_schema
from worker.logits_processor.structured import StructuredOutputsLogitsProcessor
from worker.sampling_params import SamplingParams

ENTRY_POINT_GROUP = "logitpool.logits_processors"

P = TypeVar("P", bound=LogitsProcessor)


def _keys_of(cls: type) -> frozenset[str] | None:
    # Built-ins read no extra_args (declared here, not in builtin.py, so the built-ins stay as written).
    keyless = cls in BUILTIN_PROCESSORS or cls is PenaltiesLogitsProcessor
    return frozenset() if keyless else declared_keys(cls)


BUILTIN_PROCESSORS: tuple[type[LogitsProcessor], ...] = (
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    StructuredOutputsLogitsProcessor,
    MinPLogitsProcessor,
)


def fqcn_of(cls: type) -> str:
    """``"dotted.module:ClassName"``, the form ``resolve_processor_class`` accepts."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_processor_class(spec: str | type) -> type[LogitsProcessor]:
    """A ``LogitsProcessor`` subclass from an FQCN string or a class object.

    Raises LogitsProcessorLoadError naming the FQCN and the rule it broke.
    """
    if isinstance(spec, str):
        obj = _import_fqcn(spec)
        name = spec
    else:
        obj = spec
        name = fqcn_of(spec) if inspect.isclass(spec) else repr(spec)
    if not inspect.isclass(obj):
        raise LogitsProcessorLoadError(f"logits processor {name!r}: is not a class (got {type(obj).__name__})")
    if not issubclass(obj, LogitsProcessor):
        raise LogitsProcessorLoadError(f"logits processor {name!r}: is not a subclass of LogitsProcessor")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise LogitsProcessorLoadError(f"logits processor {name!r}: is abstract (does not implement {missing})")
    return obj


def _import_fqcn(fqcn: str) -> object:
    module_name, sep, attr_path = fqcn.partition(":")
    if not sep or ":" in attr_path or not module_name or not attr_path:
        raise LogitsProcessorLoadError(
            f"logits processor {fqcn!r}: bad format, expected 'dotted.module.path:ClassName' with exactly one ':'"
        )
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:
        raise LogitsProcessorLoadError(
            f"logits processor {fqcn!r}: module {module_name!r} could not be imported ({type(exc).__name__}: {exc})"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise LogitsProcessorLoadError(
                f"logits processor {fqcn!r}: module {module_name!r} has no attribute {attr_path!r}"
            )
        obj = getattr(obj, part)
    return obj


def entry_point_classes() -> list[type[LogitsProcessor]]:
    """Every installed entry point of ``ENTRY_POINT_GROUP``, sorted by entry-point name."""
    classes = []
    for ep in sorted(_installed_entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.name, e.value)):
        try:
            classes.append(resolve_processor_class(ep.value))
        except LogitsProcessorLoadError as exc:
            raise LogitsProcessorLoadError(f"entry point {ep.name!r} in group {ENTRY_POINT_GROUP!r}: {exc}") from exc
    return classes


class LogitsProcessors:
    """The loaded, ordered set of processors a worker's sampler runs."""

    def __init__(
        self,
        processors: Sequence[LogitsProcessor],
        penalties: PenaltiesLogitsProcessor,
        *,
        strict_extra_args: bool = True,
    ) -> None:
        self.all: list[LogitsProcessor] = list(processors)
        self.penalties = penalties
        invariant = [p.is_argmax_invariant() for p in self.all]  # read once, at start-up
        self.argmax_invariant: list[LogitsProcessor] = [p for p, inv in zip(self.all, invariant) if inv]
        self.non_argmax_invariant: list[LogitsProcessor] = [p for p, inv in zip(self.all, invariant) if not inv]
        self._invariant = [*invariant, penalties.is_argmax_invariant()]
        keys = [_keys_of(type(p)) for p in self.every()]
        declared = [k for k in keys if k is not None]
        # The keys a request may use, or None when they cannot be known (checking is off).
        self.known_extra_args: frozenset[str] | None = (
            frozenset[str]().union(*declared) if strict_extra_args and len(declared) == len(keys) else None
        )

    def every(self) -> list[LogitsProcessor]:
        """Every loaded processor, penalties last."""
        return [*self.all, self.penalties]

    def fresh(self, config: object, device: torch.device, is_pin_memory: bool) -> LogitsProcessors:
        """New instances of the same classes, in the same order, with empty state (no loading)."""
        return LogitsProcessors(
            [_instantiate(type(p), config, device, is_pin_memory) for p in self.all],
            _instantiate(type(self.penalties), config, device, is_pin_memory),
            strict_extra_args=self.strict_extra_args,
        )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Tell every processor (penalties too) how the batch changed."""
        for p in self.every():
            try:
                p.update_state(batch_update)
            except Exception as exc:
                raise ProcessorError(type(p).__name__, "update_state", exc) from exc

    @property
    def strict_extra_args(self) -> bool:
        """True when unknown ``extra_args`` keys are rejected."""
        return self.known_extra_args is not None

    def validate_params(self, params: SamplingParams) -> None:
        """Reject unknown ``extra_args`` keys (when strict), then run every class's ``validate_params``.

        A ValueError propagates unchanged.
        """
        known = self.known_extra_args
        if known is not None and params.extra_args:
            unknown = sorted(k for k in params.extra_args if k not in known)
            if unknown:
                listed = ", ".join(sorted(known)) or "none"
                raise ValueError(
                    f"extra_args: unknown key(s) {', '.join(map(repr, unknown))}; "
                    f"the loaded logits processors accept: {listed}"
                )
        for p in self.every():
            type(p).validate_params(params)

    def describe(self) -> list[ProcessorInfo]:
        """Name, FQCN, argmax invariance, declared ``extra_args`` keys and JSON schema of each processor."""
        out = []
        for p, invariant in zip(self.every(), self._invariant):
            cls = type(p)
            keys = _keys_of(cls)
            out.append(
                ProcessorInfo(
                    name=cls.__name__,
                    fqcn=fqcn_of(cls),
                    argmax_invariant=invariant,
                    extra_args_keys=None if keys is None else tuple(sorted(keys)),
                    extra_args_schema=json_schema(cls),
                )
            )
        return out


@dataclass(frozen=True)
class ProcessorInfo:
    """One loaded processor as `describe()` publishes it (HTTP /v1/processors, gRPC ListProcessors)."""

    name: str
    fqcn: str
    argmax_invariant: bool
    extra_args_keys: tuple[str, ...] | None
    """Sorted declared keys; None for a processor that declares nothing (it may read any key)."""
    extra_args_schema: dict[str, Any] | None

    def as_json(self) -> dict[str, Any]:
        """JSON types (keys as a list)."""
        keys = None if self.extra_args_keys is None else list(self.extra_args_keys)
        return {**dataclasses.asdict(self), "extra_args_keys": keys}


def build_logits_processors(
    config: object,
    device: torch.device,
    is_pin_memory: bool,
    custom: Sequence[str | type] = (),
    *,
    entry_points: bool = True,
) -> LogitsProcessors:
    """Instantiate built-ins, then entry points (by name), then ``custom``; each class once.

    Strict ``extra_args`` checking follows ``config.strict_extra_args`` (on when absent).
    """
    classes: list[type[LogitsProcessor]] = list(BUILTIN_PROCESSORS)
    if entry_points:
        classes += entry_point_classes()
    classes += [resolve_processor_class(spec) for spec in custom]
    unique = list(dict.fromkeys(c for c in classes if c is not PenaltiesLogitsProcessor))
    return LogitsProcessors(
        [_instantiate(c, config, device, is_pin_memory) for c in unique],
        _instantiate(PenaltiesLogitsProcessor, config, device, is_pin_memory),
        strict_extra_args=bool(getattr(config, "strict_extra_args", True)),
    )


def _instantiate(cls: type[P], config: object, device: torch.device, is_pin_memory: bool) -> P:
    try:
        return cls(config, device, is_pin_memory)
    except Exception as exc:
        raise LogitsProcessorLoadError(
            f"logits processor {fqcn_of(cls)!r}: constructor raised {type(exc).__name__}: {exc}"
        ) from exc

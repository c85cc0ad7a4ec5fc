"""The logits-processor programming model (docs/sampling.md "Programming model").

vLLM v1's names, so ports change imports only.

The interface, adapter, row-state helper and errors import eagerly. The loading machinery and
built-in processors (``registry``, ``builtin``, ``penalties``) import on first use, so the
built-ins can themselves import from this package without an import cycle.
"""

from __future__ import annotations

import importlib
from typing import Any

from worker.logits_processor.adapter import AdapterLogitsProcessor, RequestLogitsProcessor
from worker.logits_processor.errors import LogitsProcessorLoadError, ProcessorError
from worker.logits_processor.interface import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
    MovedRequest,
    RemovedRequest,
)
from worker.logits_processor.state import RowStates

# public name -> the submodule that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "LogitsProcessors": "registry",
    "build_logits_processors": "registry",
    "resolve_processor_class": "registry",
    "fqcn_of": "registry",
    "entry_point_classes": "registry",
    "ENTRY_POINT_GROUP": "registry",
    "BUILTIN_PROCESSORS": "registry",
    "AllowedTokenIdsLogitsProcessor": "builtin",
    "BadWordsLogitsProcessor": "builtin",
    "MinTokensLogitsProcessor": "builtin",
    "LogitBiasLogitsProcessor": "builtin",
    "MinPLogitsProcessor": "builtin",
    "PenaltiesLogitsProcessor": "penalties",
    "ExtraArgs": "schema",
    "parse_extra_args": "schema",
    "StructuredOutputsLogitsProcessor": "structured",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # noqa: PLE0604 - the lazy names, listed once in _LAZY
    "AddedRequest",
    "AdapterLogitsProcessor",
    "BatchUpdate",
    "LogitsProcessor",
    "LogitsProcessorLoadError",
    "MoveDirectionality",
    "MovedRequest",
    "ProcessorError",
    "RemovedRequest",
    "RequestLogitsProcessor",
    "RowStates",
    *_LAZY,
]

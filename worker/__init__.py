"""The engine a logitpool worker runs: torch + transformers, never Ray.

``LLM`` (offline) and ``AsyncEngine`` (streaming) are imported lazily so that importing a
processor's dependencies (``worker.logits_processor``, ``SamplingParams``) stays light.
"""

from typing import TYPE_CHECKING

from worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from worker.async_engine import AsyncEngine
    from worker.config import EngineConfig
    from worker.llm import LLM
    from worker.outputs import CompletionOutput, RequestOutput

_LAZY = {
    "LLM": "worker.llm",
    "AsyncEngine": "worker.async_engine",
    "EngineConfig": "worker.config",
    "RequestOutput": "worker.outputs",
    "CompletionOutput": "worker.outputs",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'worker' has no attribute {name!r}")


__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]

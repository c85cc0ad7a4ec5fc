"""Errors raised while loading or running logits processors."""

from __future__ import annotations


class LogitsProcessorLoadError(ValueError):
    """A configured processor could not be loaded; the message names it and the rule it broke."""


class ProcessorError(RuntimeError):
    """A processor raised in ``update_state`` or ``apply``; the engine isolates the failure.

    ``processor`` is the processor's class name, ``phase`` is "update_state" or "apply".
    """

    def __init__(self, processor: str, phase: str, cause: BaseException) -> None:
        super().__init__(f"logits processor {processor} failed in {phase}: {type(cause).__name__}: {cause}")
        self.processor = processor
        self.phase = phase
        self.cause = cause

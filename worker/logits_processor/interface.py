"""The batch-level logits-processor programming model (docs/sampling.md "Programming model").

vLLM v1's names and signatures.

A processor written for vLLM ports by changing its imports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, ClassVar

import torch
from pydantic import BaseModel

from worker.logits_processor.schema import parse_extra_args
from worker.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    # One-way i1->i2 request move within the batch
    UNIDIRECTIONAL = auto()
    # Two-way i1<->i2 request swap within the batch
    SWAP = auto()


# (index, params, prompt token ids, output token ids). The output list is a live reference to
# the request's running output: it grows every step with no further notification.
AddedRequest = tuple[int, SamplingParams, "list[int] | None", "list[int]"]

# (from index, to index, directionality)
MovedRequest = tuple[int, int, MoveDirectionality]

# Batch index of a removed request.
RemovedRequest = int


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed at the start of a step.

    Apply removes, then adds, then moves (in list order). An Add's index is the index at the
    time of the Add, before any move. ``batch_size`` is the number of rows after the update.
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    moved: Sequence[MovedRequest]
    added: Sequence[AddedRequest]


class LogitsProcessor(ABC):
    """A stateful, batch-level transform of the ``(num_requests, vocab_size)`` logits.

    The ``extra_args`` keys it owns may be declared (``worker.logits_processor.schema``): a
    pydantic model in ``extra_args_model`` (validated by the default ``validate_params`` and
    published as a JSON schema), a JSON schema dict in ``extra_args_schema``, or bare names in
    ``extra_args_keys`` (``()``: reads none). Declaring nothing is allowed but turns strict key
    checking off while the processor is loaded.
    """

    extra_args_model: ClassVar[type[BaseModel] | None] = None
    extra_args_schema: ClassVar[dict[str, Any] | None] = None  # JSON
    extra_args_keys: ClassVar[tuple[str, ...] | None] = None

    # ``config``: the host's config object (vLLM's VllmConfig there, the worker's EngineConfig here,
    # None in tests), untyped on purpose so a vLLM processor ports as is; read it with getattr.
    @abstractmethod
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform the rows of the requests that enabled this processor (in place preferred)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if this processor never changes a row's highest-logit token.

        Read once at start-up; an instance method because it may depend on config.
        """
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every forward pass; ``None`` means the batch make-up did not change."""
        raise NotImplementedError

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError for request parameters this processor cannot accept.

        By default: validate the keys ``extra_args_model`` declares (nothing when it is None).
        """
        parse_extra_args(cls, params)

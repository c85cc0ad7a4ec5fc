"""AdapterLogitsProcessor: turn request-level callables into a batch-level processor (vLLM's API).

A subclass says, per request, which callable (if any) to run on that request's logits row.
The callable's arity is inspected once, when it is created for a request; ``apply`` then only
calls a prebound partial per enabled row. Sparse by design: a loop over enabled rows.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch

from worker.logits_processor.interface import BatchUpdate, LogitsProcessor
from worker.logits_processor.state import RowStates
from worker.sampling_params import SamplingParams

# (output token ids, logits row) -> logits row
_OutputRowFn = Callable[[list[int], torch.Tensor], torch.Tensor]
# (prompt token ids, output token ids, logits row) -> logits row
_PromptOutputRowFn = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
RequestLogitsProcessor = _OutputRowFn | _PromptOutputRowFn

# A request's callable with its token lists already bound: logits row -> logits row.
_BoundRowFn = Callable[[torch.Tensor], torch.Tensor]


def _positional_arity(fn: Callable[..., object]) -> int:
    """How many positional arguments ``fn`` takes (2 or 3 accepted); -1 for ``*args``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"request logits processor {fn!r} has no inspectable signature") from exc
    kinds = [p.kind for p in sig.parameters.values()]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return -1
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(k in positional for k in kinds)


def bind_request_logits_processor(
    fn: RequestLogitsProcessor, prompt_ids: list[int] | None, output_ids: list[int]
) -> _BoundRowFn:
    """Bind the token lists once; ``output_ids`` stays the live list the engine appends to."""
    arity = _positional_arity(fn)  # tells the two shapes apart, which the type checker cannot
    if arity == 3:
        return partial(cast(_PromptOutputRowFn, fn), prompt_ids if prompt_ids is not None else [], output_ids)
    if arity == 2:
        return partial(cast(_OutputRowFn, fn), output_ids)
    raise TypeError(
        f"request logits processor {fn!r} must take (output_ids, logits) or "
        f"(prompt_ids, output_ids, logits), it takes {'*args' if arity < 0 else arity} positional arguments"
    )


class AdapterLogitsProcessor(LogitsProcessor):
    """Batch-level wrapper around per-request callables.

    Subclasses implement ``new_req_logits_processor`` (None = not enabled for that request)
    and ``is_argmax_invariant``, and may override ``validate_params``.
    """

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.config = config
        self.device = device
        self.is_pin_memory = is_pin_memory
        self._req_fns: RowStates[_BoundRowFn] = RowStates(self._new_state)

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The callable for one request, or None when this processor does not apply to it."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        raise NotImplementedError

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _BoundRowFn | None:
        fn = self.new_req_logits_processor(params)
        return None if fn is None else bind_request_logits_processor(fn, prompt_ids, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self._req_fns.update(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, fn in self._req_fns.items():
            logits[row] = fn(logits[row])
        return logits

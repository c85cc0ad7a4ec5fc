"""Shared plumbing of the library processors: typed per-request args, active rows, write-back.

Every library processor owns a few ``extra_args`` keys, declared as an ``ExtraArgs`` model. A
request enables it by setting them; the rows that did are kept in a ``RowStates`` (moved with
the batch by the one shared helper), and ``apply`` works on those rows only: the whole batch in
place when every row is active, else a gathered ``[n, V]`` block written back with one
``index_copy_``. No active row: the input is returned untouched, and ``update_state(None)``
returns at once.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar, cast

import torch

from worker.logits_processor.builtin import _SparseRows
from worker.logits_processor.schema import ExtraArgs, parse_extra_args
from worker.ops.scratch import Buffer
from worker.sampling_params import SamplingParams

T = TypeVar("T")  # a row's state
A = TypeVar("A", bound=ExtraArgs)  # the processor's extra_args_model
NEG_INF = float("-inf")


class LibraryProcessor(_SparseRows[T], Generic[T, A]):
    """A processor enabled per request by its ``extra_args_model`` (``A``) keys; ``T``: a row's state."""

    # Greedy requests ask for the top token: samplers (XTC, typical-p, ...) leave them alone;
    # penalties (DRY, no-repeat-ngram) act on them too.
    acts_on_greedy: ClassVar[bool] = False

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)
        self._gathered = Buffer()
        self._row_list: list[int] = []

    def _state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> T | None:
        if params.is_greedy and not self.acts_on_greedy:
            return None
        # parse_extra_args builds this class's own extra_args_model, which is A.
        args = cast("A | None", parse_extra_args(type(self), params))
        return None if args is None else self._row_state(args, params, prompt_ids, output_ids)

    def _row_state(
        self, args: A, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> T | None:
        """The row's state from its validated args, or None when the args leave it off."""
        raise NotImplementedError

    def _rebuild(self, vocab_size: int) -> None:
        items = list(self.states.items())
        self._row_list = [r for r, _ in items]
        self._rows = self._stage(self._row_list, torch.int64)
        self._rebuild_rows(items)

    def _rebuild_rows(self, items: list[tuple[int, T]]) -> None:
        """Dense per-row values for ``apply`` (rows in ascending order); none by default."""

    def _whole(self, logits: torch.Tensor) -> bool:
        return len(self._row_list) == logits.shape[0]  # rows are distinct and < batch size

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """The active rows: ``logits`` itself when every row is active, else a scratch copy."""
        if self._whole(logits):
            return logits
        shape = (len(self._row_list), logits.shape[1])
        return torch.index_select(logits, 0, self._rows, out=self._gathered.take(shape, logits.dtype, logits.device))

    def scatter(self, logits: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        """Write ``gather``'s block back (nothing to do when it was ``logits`` itself)."""
        if sub is not logits:
            logits.index_copy_(0, self._rows, sub)
        return logits


def drop_below(x: torch.Tensor, probs: torch.Tensor, cutoff: torch.Tensor) -> torch.Tensor:
    """``x`` with tokens whose probability is below ``cutoff`` set to -inf, the row's top token kept.

    transformers' epsilon/eta rule (``min_tokens_to_keep=1``): a token goes when
    ``probs < cutoff`` and its logit is below the row max.
    """
    remove = (probs < cutoff) & (x < x.amax(-1, keepdim=True))
    return x.masked_fill_(remove, NEG_INF)

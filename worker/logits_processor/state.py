"""The one helper that applies a BatchUpdate to sparse per-row state (removes, adds, moves).

Every built-in processor keeps its per-request settings in a ``RowStates`` keyed by batch row;
dense tensors for ``apply`` are rebuilt from it only when it changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from worker.logits_processor.interface import BatchUpdate, MoveDirectionality
from worker.sampling_params import SamplingParams

T = TypeVar("T")

# (params, prompt token ids, live output token ids) -> the row's state, or None when the
# processor is not enabled for that request.
StateFactory = Callable[[SamplingParams, "list[int] | None", "list[int]"], "T | None"]


class RowStates(Generic[T]):
    """Row index -> state for the rows that enabled a processor."""

    def __init__(self, factory: StateFactory) -> None:
        self._factory = factory
        self._rows: dict[int, T] = {}

    def update(self, batch_update: BatchUpdate | None) -> bool:
        """Apply one BatchUpdate; return True when the set of rows or their states changed."""
        if batch_update is None:
            return False
        rows = self._rows
        changed = False
        for index in batch_update.removed:
            changed |= rows.pop(index, None) is not None
        for index, params, prompt_ids, output_ids in batch_update.added:
            state = self._factory(params, prompt_ids, output_ids)
            if state is None:
                changed |= rows.pop(index, None) is not None
            else:
                rows[index] = state
                changed = True
        for src, dst, kind in batch_update.moved:
            a = rows.pop(src, None)
            b = rows.pop(dst, None)
            if a is not None:
                rows[dst] = a
            if kind == MoveDirectionality.SWAP and b is not None:
                rows[src] = b
            changed |= a is not None or b is not None
        return changed

    def __len__(self) -> int:
        return len(self._rows)

    def __bool__(self) -> bool:
        return bool(self._rows)

    def __contains__(self, row: int) -> bool:
        return row in self._rows

    def __getitem__(self, row: int) -> T:
        return self._rows[row]

    def items(self) -> Iterator[tuple[int, T]]:
        return iter(sorted(self._rows.items()))

    def clear(self) -> None:
        self._rows.clear()

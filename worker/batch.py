"""PersistentBatch: the rows of running requests and the BatchUpdate that says how they changed.

Row layout follows docs/sampling.md "Row layout" exactly (replace finished rows lowest first, append the rest,
otherwise remove and condense, then optional swaps). Per-row sampling values live in CPU
columns declared once in ``COLUMNS`` and are moved with their rows by ``_move``/``_swap``;
``sampling_metadata()`` turns them into the sampler's view, cached until the batch changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from worker.logits_processor.interface import AddedRequest, BatchUpdate, MoveDirectionality, MovedRequest
from worker.ops.staging import DoubleBuffer
from worker.sampling_metadata import HostColumns, SamplingMetadata
from worker.sampling_params import SamplingParams

# (request id, params, prompt token ids, LIVE output token ids[, the request's own generator])
# A request that brings its generator (a preempted seeded one resuming) keeps its random stream.
NewRequest = (
    tuple[str, SamplingParams, "list[int] | None", "list[int]"]
    | tuple[str, SamplingParams, "list[int] | None", "list[int]", "torch.Generator | None"]
)
# Row order (request ids) after steps 1-4 -> the SWAP pairs of step 5.
SwapPolicy = Callable[[list[str]], Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class Column:
    """One per-row sampling value: its dtype, the value of an empty slot, and how to read it."""

    name: str
    dtype: torch.dtype
    default: float | int | bool
    getter: Callable[[SamplingParams], float | int | bool]


# A top_k at or above the vocabulary size keeps every token; any int64 value is valid, so the
# column stores min(top_k, this) (far above any vocabulary) and the plan sees "off".
_TOP_K_CAP = 2**31 - 1


def _top_k(p: SamplingParams) -> int:
    return 0 if p.is_greedy or p.top_k == -1 else min(p.top_k, _TOP_K_CAP)


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A request's own generator. Seeds span [-2**63, 2**64) (docs/sampling.md "Validation and ranges");
    ``manual_seed`` takes ``seed % 2**64`` (the same stream torch gives a negative seed)."""
    return torch.Generator(device=device).manual_seed(seed % 2**64)


def _top_p(p: SamplingParams) -> float:
    return 1.0 if p.is_greedy else float(p.top_p)


COLUMNS: tuple[Column, ...] = (
    Column("temperature", torch.float32, 1.0, lambda p: float(p.temperature)),
    # Kept as its own column: float32(temperature) < 1e-5 can disagree with params.is_greedy.
    Column("greedy", torch.bool, False, lambda p: p.is_greedy),
    Column("top_k", torch.int64, 0, _top_k),
    Column("top_p", torch.float32, 1.0, _top_p),
    Column("num_logprobs", torch.int64, -1, lambda p: -1 if p.logprobs is None else p.logprobs),
    Column("uses_penalties", torch.bool, False, lambda p: p.uses_penalties),
)


@dataclass
class _Row:
    """The python-side values of one row; moved as one object together with the columns."""

    req_id: str
    params: SamplingParams
    prompt_ids: list[int] | None
    output_ids: list[int]  # the caller's live list, never copied
    generator: torch.Generator | None


@dataclass(frozen=True)
class _Plan:
    """Where rows go in one update, computed on request ids before any row is touched."""

    order: list[str]  # row order after steps 1-4
    added_rows: list[int]  # the row of each new request, in the order given
    removed: list[int]
    moves: list[tuple[int, int]]  # condense moves (src, dst), in order


def _plan(order: list[str], finished_rows: list[int], new_ids: list[str]) -> _Plan:
    """docs/sampling.md "Row layout" steps 2-4 on a plain list of ids: replace lowest first, append, or condense."""
    slots: list[str | None] = list(order)
    replaced = finished_rows[: len(new_ids)]
    added_rows = replaced + list(range(len(slots), len(slots) + len(new_ids) - len(replaced)))
    removed = finished_rows[len(new_ids) :]
    for row in removed:
        slots[row] = None
    slots += [None] * (len(added_rows) - len(replaced))
    for row, rid in zip(added_rows, new_ids):
        slots[row] = rid
    moves: list[tuple[int, int]] = []
    low, high = 0, len(slots) - 1
    while True:  # lowest empty <- highest non-empty, until contiguous
        while low < len(slots) and slots[low] is not None:
            low += 1
        while high >= 0 and slots[high] is None:
            high -= 1
        if low >= high:
            break
        slots[low], slots[high] = slots[high], None
        moves.append((high, low))
    return _Plan([rid for rid in slots if rid is not None], added_rows, removed, moves)


class PersistentBatch:
    """Rows ``0..num_reqs-1`` of running requests, kept contiguous between steps."""

    def __init__(self, max_num_reqs: int, device: torch.device = torch.device("cpu"), pin_memory: bool = False) -> None:
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs: must be >= 1, got {max_num_reqs}")
        self.max_num_reqs = max_num_reqs
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self._rows: list[_Row | None] = [None] * max_num_reqs
        self._num_reqs = 0
        self._index: dict[str, int] = {}
        self._cols: dict[str, torch.Tensor] = {
            c.name: torch.full((max_num_reqs,), c.default, dtype=c.dtype) for c in COLUMNS
        }
        # The columns reach the device through pinned double buffers: a column is rewritten by the
        # next update, maybe while its last non-blocking copy is still reading it.
        self._staging = {c.name: DoubleBuffer(c.dtype, self.device, pin_memory) for c in COLUMNS}
        self._metadata: SamplingMetadata | None = None

    # -- reading ---------------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return self._num_reqs

    @property
    def req_ids(self) -> list[str]:
        return [self._row(i).req_id for i in range(self._num_reqs)]

    def index_of(self, req_id: str) -> int:
        try:
            return self._index[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} is not in the batch") from None

    def params_of(self, row: int) -> SamplingParams:
        return self._row(row).params

    def output_ids_of(self, row: int) -> list[int]:
        return self._row(row).output_ids

    def generator_of(self, row: int) -> torch.Generator | None:
        return self._row(row).generator

    def column(self, name: str) -> torch.Tensor:
        """The CPU column ``name`` for rows ``0..num_reqs-1`` (a view: read, do not write)."""
        return self._cols[name][: self._num_reqs]

    def _row(self, row: int) -> _Row:
        if not 0 <= row < self._num_reqs:
            raise IndexError(f"row {row} out of range for a batch of {self._num_reqs}")
        r = self._rows[row]
        assert r is not None  # rows below num_reqs are never empty between updates
        return r

    # -- the one BatchUpdate builder -------------------------------------------------------

    def update(
        self,
        finished: Iterable[str],
        new: Sequence[NewRequest],
        swaps: Sequence[tuple[int, int]] | SwapPolicy = (),
    ) -> BatchUpdate | None:
        """Apply one step's changes (docs/sampling.md "Row layout" steps 1-5); None when nothing was
        added/removed/moved.

        ``swaps`` is a list of row pairs, or a callable that receives the row order after steps
        1-4 (request ids) and returns the pairs. The whole update is planned and validated
        before any row changes, so a ValueError leaves the batch intact.
        """
        finished_rows = self._check(list(finished), new)
        plan = _plan(self.req_ids, finished_rows, [rid for rid, *_ in new])
        swap_list = [(int(i), int(j)) for i, j in (swaps(list(plan.order)) if callable(swaps) else swaps)]
        size = len(plan.order)
        for i, j in swap_list:
            if not (0 <= i < size and 0 <= j < size) or i == j:
                raise ValueError(f"swaps: ({i}, {j}) must name two different rows of a batch of {size}")

        for row in finished_rows:
            del self._index[self._row(row).req_id]
        added = [self._add(row, req) for row, req in zip(plan.added_rows, new)]
        for row in plan.removed:
            self._clear(row)
        for src, dst in plan.moves:
            self._move(src, dst)
        for i, j in swap_list:
            self._swap(i, j)
        self._num_reqs = size

        moved: list[MovedRequest] = [(s, d, MoveDirectionality.UNIDIRECTIONAL) for s, d in plan.moves]
        moved += [(i, j, MoveDirectionality.SWAP) for i, j in swap_list]
        if not (added or plan.removed or moved):
            return None
        self._metadata = None
        return BatchUpdate(batch_size=size, removed=list(plan.removed), moved=moved, added=added)

    def _check(self, finished: list[str], new: Sequence[NewRequest]) -> list[int]:
        """Rows of the finished requests (ascending); ValueError for anything inconsistent."""
        rows: list[int] = []
        for rid in finished:
            if rid not in self._index:
                raise ValueError(f"finished: request {rid!r} is not in the batch")
            rows.append(self._index[rid])
        if len(set(rows)) != len(rows):
            raise ValueError(f"finished: a request is listed twice in {finished!r}")
        seen: set[str] = set()
        for rid, *_ in new:
            if rid in self._index or rid in seen:
                raise ValueError(f"new: request {rid!r} is already in the batch")
            seen.add(rid)
        size = self._num_reqs - len(rows) + len(new)
        if size > self.max_num_reqs:
            raise ValueError(f"new: {size} requests would exceed max_num_reqs={self.max_num_reqs}")
        return sorted(rows)

    # -- the one place rows are written and moved -------------------------------------------

    def _add(self, row: int, req: NewRequest) -> AddedRequest:
        rid, params, prompt_ids, output_ids, *own = req
        # The request's own generator when it has one (it survives preemption and rebuilds).
        gen = own[0] if own else None
        if gen is None and params.seed is not None:
            gen = seeded_generator(params.seed, self.device)
        self._rows[row] = _Row(rid, params, prompt_ids, output_ids, gen)
        self._index[rid] = row
        for c in COLUMNS:
            self._cols[c.name][row] = c.getter(params)
        return (row, params, prompt_ids, output_ids)

    def _clear(self, row: int) -> None:
        self._rows[row] = None
        for c in COLUMNS:
            self._cols[c.name][row] = c.default

    def _move(self, src: int, dst: int) -> None:
        r = self._rows[src]
        assert r is not None
        self._rows[dst], self._rows[src] = r, None
        self._index[r.req_id] = dst
        for col in self._cols.values():
            col[dst] = col[src]
        self._clear(src)

    def _swap(self, i: int, j: int) -> None:
        a, b = self._rows[i], self._rows[j]
        assert a is not None and b is not None
        self._rows[i], self._rows[j] = b, a
        self._index[a.req_id], self._index[b.req_id] = j, i
        idx = torch.tensor([i, j])
        for col in self._cols.values():
            col[idx] = col[idx.flip(0)]

    # -- the sampler's view ----------------------------------------------------------------

    def sampling_metadata(self) -> SamplingMetadata:
        """The sampler's per-row view; cached, rebuilt only after an update changed the batch."""
        if self._metadata is None:
            self._metadata = self._build_metadata()
        return self._metadata

    def _build_metadata(self) -> SamplingMetadata:
        n = self._num_reqs
        cpu = {name: col[:n] for name, col in self._cols.items()}

        def dev(name: str) -> torch.Tensor:
            return self._staging[name].stage(cpu[name])  # never aliases the column

        greedy = cpu["greedy"]
        num_greedy = int(greedy.sum())
        uses_top_k = bool((cpu["top_k"] > 0).any())
        uses_top_p = bool((cpu["top_p"] < 1.0).any())
        asks = cpu["num_logprobs"] >= 0
        rows = [self._row(i) for i in range(n)]
        return SamplingMetadata(
            temperature=dev("temperature"),
            greedy_mask=dev("greedy"),
            all_greedy=num_greedy == n,
            all_random=num_greedy == 0,
            top_k=dev("top_k") if uses_top_k else None,
            top_p=dev("top_p") if uses_top_p else None,
            generators={i: r.generator for i, r in enumerate(rows) if r.generator is not None},
            max_num_logprobs=int(cpu["num_logprobs"].max()) if bool(asks.any()) else None,
            num_logprobs=dev("num_logprobs") if bool(asks.any()) else None,
            logprobs_modes=tuple(r.params.logprobs_mode for r in rows),
            no_penalties=not bool(cpu["uses_penalties"].any()),
            host=HostColumns(
                tuple(greedy.tolist()),
                tuple(cpu["top_k"].tolist()),
                tuple(cpu["top_p"].tolist()),
                tuple(cpu["num_logprobs"].tolist()),
            ),
        )

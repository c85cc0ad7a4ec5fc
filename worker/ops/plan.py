"""The host-side view of a batch's sampling settings, built once per SamplingMetadata.

The metadata is rebuilt only when the persistent batch changes; the plan reads its host columns
(``SamplingMetadata.host``, no device read at all; metadata without them is read back in one
transfer). The plan groups rows by the work they need (greedy, top-k, full-vocabulary) and keeps
the device index tensors the sampler uses every step, copied from pinned memory without a sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from worker.ops.host_sync import host_lists
from worker.ops.staging import to_device
from worker.sampling_metadata import HostColumns, SamplingMetadata

RAW_MODES = ("raw_logprobs", "raw_logits")


class Run(NamedTuple):
    """``length`` rows that are consecutive both in the batch (from ``batch``) and in a group (from ``local``)."""

    batch: int
    local: int
    length: int


def runs_of(rows: Sequence[int]) -> tuple[Run, ...]:
    """``rows`` cut into runs: a kernel applied to each run's slice of the batch reads no other row
    and needs no gathered copy (one run when the rows are the whole batch in order)."""
    out: list[Run] = []
    for local, r in enumerate(rows):
        if out and out[-1].batch + out[-1].length == r:
            out[-1] = out[-1]._replace(length=out[-1].length + 1)
        else:
            out.append(Run(r, local, 1))
    return tuple(out)


@dataclass(frozen=True)
class RowGroup:
    """Batch rows in a fixed order, with their device index tensor and their runs."""

    rows: tuple[int, ...]
    index: torch.Tensor  # [n] int64
    runs: tuple[Run, ...]

    def __len__(self) -> int:
        return len(self.rows)


def row_group(rows: Sequence[int], device: torch.device) -> RowGroup:
    return RowGroup(tuple(rows), to_device(rows, torch.int64, device), runs_of(rows))


@dataclass(frozen=True)
class SamplingPlan:
    batch_size: int
    vocab_size: int
    greedy: RowGroup
    random: RowGroup  # every other row, in batch order (7a divides these)
    # Random rows with 0 < top_k < V: drawn among their top-k candidates.
    topk: RowGroup
    topk_k: torch.Tensor  # [nk] int64
    topk_kmax: int
    topk_p: torch.Tensor  # [nk] float64, 1.0 = no top-p
    # Other random rows, drawn over the full vocabulary; the first ``n_top_p`` use top-p.
    full: RowGroup
    n_top_p: int
    top_p: torch.Tensor  # [n_top_p] float64
    divisor: torch.Tensor | None  # [B, 1] float32 temperature, 1.0 on greedy rows; None if all greedy
    generators: Mapping[int, torch.Generator]
    seeded_index: torch.Tensor  # positions in ``random_rows`` of the rows with their own generator
    # Logprobs: K (None: nobody asks), rows asking a raw / a processed mode (with their modes).
    num_logprobs: int | None
    raw: RowGroup
    raw_modes: tuple[str, ...]
    processed: RowGroup
    processed_modes: tuple[str, ...]

    @property
    def all_greedy(self) -> bool:
        return len(self.greedy) == self.batch_size

    @property
    def random_rows(self) -> tuple[int, ...]:
        """Draw order: top-k rows, then full rows."""
        return self.topk.rows + self.full.rows


def _host_columns(md: SamplingMetadata) -> HostColumns:
    if md.host is not None:
        return md.host
    b = md.batch_size
    tensors = [md.greedy_mask] + [t for t in (md.top_k, md.top_p, md.num_logprobs) if t is not None]
    lists = iter(host_lists(*tensors, label="sampling plan"))
    greedy = next(lists)
    top_k = next(lists) if md.top_k is not None else [0] * b
    top_p = next(lists) if md.top_p is not None else [1.0] * b
    nl = next(lists) if md.num_logprobs is not None else [-1] * b
    return HostColumns(tuple(greedy), tuple(top_k), tuple(top_p), tuple(nl))


def build_plan(md: SamplingMetadata, vocab_size: int, device: torch.device) -> SamplingPlan:
    b = md.batch_size
    host = _host_columns(md)
    greedy, top_k, top_p = host.greedy, host.top_k, host.top_p
    rnd = [i for i in range(b) if not greedy[i]]
    topk_rows = [i for i in rnd if 0 < top_k[i] < vocab_size]
    others = [i for i in rnd if not 0 < top_k[i] < vocab_size]
    full_rows = [i for i in others if top_p[i] < 1.0] + [i for i in others if top_p[i] >= 1.0]
    n_top_p = sum(1 for i in others if top_p[i] < 1.0)
    divisor = None
    if rnd:
        divisor = torch.where(md.greedy_mask, 1.0, md.temperature).to(torch.float32)[:, None].to(device)

    nl = host.num_logprobs if md.max_num_logprobs is not None else (-1,) * b
    modes = md.logprobs_modes if len(md.logprobs_modes) == b else ("raw_logprobs",) * b
    asking = [i for i in range(b) if nl[i] >= 0]
    raw = [i for i in asking if modes[i] in RAW_MODES]
    processed = [i for i in asking if modes[i] not in RAW_MODES]
    random_rows = topk_rows + full_rows
    return SamplingPlan(
        batch_size=b,
        vocab_size=vocab_size,
        greedy=row_group([i for i in range(b) if greedy[i]], device),
        random=row_group(rnd, device),
        topk=row_group(topk_rows, device),
        topk_k=to_device([top_k[i] for i in topk_rows], torch.int64, device),
        topk_kmax=max((top_k[i] for i in topk_rows), default=0),
        topk_p=to_device([top_p[i] for i in topk_rows], torch.float64, device),
        full=row_group(full_rows, device),
        n_top_p=n_top_p,
        top_p=to_device([top_p[i] for i in full_rows[:n_top_p]], torch.float64, device),
        divisor=divisor,
        generators=md.generators,
        seeded_index=to_device([j for j, r in enumerate(random_rows) if r in md.generators], torch.int64, device),
        num_logprobs=md.max_num_logprobs if asking else None,
        raw=row_group(raw, device),
        raw_modes=tuple(modes[i] for i in raw),
        processed=row_group(processed, device),
        processed_modes=tuple(modes[i] for i in processed),
    )

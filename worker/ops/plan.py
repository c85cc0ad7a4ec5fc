"""The host-side view of a batch's sampling settings, built once per SamplingMetadata.

The metadata is rebuilt only when the persistent batch changes, so reading its small per-row
tensors to the host here costs one transfer per batch change, not per step. The plan groups
rows by the work they need (greedy, top-k, full-vocabulary) and keeps the device index tensors
the sampler uses every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from worker.sampling_metadata import SamplingMetadata

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
    return RowGroup(tuple(rows), torch.tensor(list(rows), dtype=torch.int64, device=device), runs_of(rows))


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


def build_plan(md: SamplingMetadata, vocab_size: int, device: torch.device) -> SamplingPlan:
    b = md.batch_size
    greedy = md.greedy_mask.tolist()
    top_k = md.top_k.tolist() if md.top_k is not None else [0] * b
    top_p = md.top_p.tolist() if md.top_p is not None else [1.0] * b
    rnd = [i for i in range(b) if not greedy[i]]
    topk_rows = [i for i in rnd if 0 < top_k[i] < vocab_size]
    others = [i for i in rnd if not 0 < top_k[i] < vocab_size]
    full_rows = [i for i in others if top_p[i] < 1.0] + [i for i in others if top_p[i] >= 1.0]
    n_top_p = sum(1 for i in others if top_p[i] < 1.0)
    divisor = None
    if rnd:
        divisor = torch.where(md.greedy_mask, 1.0, md.temperature).to(torch.float32)[:, None].to(device)

    nl = md.num_logprobs.tolist() if md.num_logprobs is not None and md.max_num_logprobs is not None else [-1] * b
    modes = md.logprobs_modes if len(md.logprobs_modes) == b else ("raw_logprobs",) * b
    asking = [i for i in range(b) if nl[i] >= 0]
    raw = [i for i in asking if modes[i] in RAW_MODES]
    processed = [i for i in asking if modes[i] not in RAW_MODES]
    return SamplingPlan(
        batch_size=b,
        vocab_size=vocab_size,
        greedy=row_group([i for i in range(b) if greedy[i]], device),
        random=row_group(rnd, device),
        topk=row_group(topk_rows, device),
        topk_k=torch.tensor([top_k[i] for i in topk_rows], dtype=torch.int64, device=device),
        topk_kmax=max((top_k[i] for i in topk_rows), default=0),
        topk_p=torch.tensor([top_p[i] for i in topk_rows], dtype=torch.float64, device=device),
        full=row_group(full_rows, device),
        n_top_p=n_top_p,
        top_p=torch.tensor([top_p[i] for i in full_rows[:n_top_p]], dtype=torch.float64, device=device),
        divisor=divisor,
        generators=md.generators,
        num_logprobs=md.max_num_logprobs if asking else None,
        raw=row_group(raw, device),
        raw_modes=tuple(modes[i] for i in raw),
        processed=row_group(processed, device),
        processed_modes=tuple(modes[i] for i in processed),
    )

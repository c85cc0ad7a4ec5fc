"""Exact draws by inverse CDF: one float64 uniform per row, never one random number per token.

Row totals are the last entry of a running (sequential) sum, never a tree reduction: a row's
result then does not depend on how wide the batch pads its candidate lists, nor on how many
rows share the reduction, which keeps seeded rows bit-identical in any batch.

``draw_rows`` works on full [n, V] weight rows in two levels: block sums locate the block
holding the target mass, then a cumulative sum of that one block finds the token. A token of
zero weight is never returned; rounding that pushes the target past the last positive weight
lands on the last positive weight instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from worker.ops.blocks import block_columns, block_reduce, block_size, gather_blocks
from worker.ops.plan import RowGroup
from worker.ops.staging import to_device


def uniforms(
    rows: Sequence[int],
    generators: Mapping[int, torch.Generator],
    default: torch.Generator | None,
    device: torch.device,
    seeded_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """[len(rows)] float64 in [0, 1): seeded rows draw exactly one value from their own generator.

    Unseeded rows share ``default`` (the global RNG when None) in row order; a seeded row's
    value depends only on its generator, never on the rest of the batch. ``seeded_index``: the
    positions in ``rows`` of the seeded rows as a device tensor, when the caller keeps one (the
    plan does: building it here would be a host-to-device copy every step).
    """
    gen_device = default.device if default is not None else device
    u = torch.rand(len(rows), dtype=torch.float64, generator=default, device=gen_device).to(device)
    seeded = [i for i, r in enumerate(rows) if r in generators]
    if seeded:
        own = [
            torch.rand(1, dtype=torch.float64, generator=generators[rows[i]], device=generators[rows[i]].device)
            for i in seeded
        ]
        index = seeded_index if seeded_index is not None else to_device(seeded, torch.int64, device)
        u.index_copy_(0, index, torch.cat([t.to(device) for t in own]))
    return u


def row_total(w: torch.Tensor) -> torch.Tensor:
    """[n] sum of each row of ``w`` [n, m] as a sequential running sum (layout-independent)."""
    return w.cumsum(-1)[:, -1]


def _last_positive(w: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(w.shape[-1], device=w.device).expand_as(w)
    return torch.where(w > 0, cols, -1).amax(-1).clamp_min(0)


def search(w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """[n] column where the running sum of ``w`` [n, m] (float64, >= 0) first exceeds ``t`` [n]."""
    cs = w.cumsum(-1)
    j = torch.searchsorted(cs, t[:, None], right=True).squeeze(1)
    return torch.minimum(j, _last_positive(w))


def draw_weights(w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(column [n], ok [n]) drawn from weights ``w`` [n, m] (>= 0, any float dtype) with uniforms ``u``.

    ``ok`` is False where the row has no positive finite mass; its column is then meaningless.
    """
    w = w.to(torch.float64)
    total = row_total(w)
    ok = (total > 0) & torch.isfinite(total)
    w = torch.where(ok[:, None], w, 0.0)
    return search(w, u * torch.where(ok, total, 0.0)), ok


def draw_rows(
    probs: torch.Tensor, u: torch.Tensor, block_sums: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token id [n], ok [n]) drawn from full rows of weights ``probs`` [n, V] (float32, >= 0).

    ``block_sums`` ([n, nb], as ``row_block_sums`` returns) may be passed when already computed.
    """
    _, v = probs.shape
    bs = block_size(v)
    if block_sums is None:
        block_sums = row_block_sums(probs)
    bsum = block_sums.to(torch.float64)
    total = row_total(bsum)
    ok = (total > 0) & torch.isfinite(total)
    bsum = torch.where(ok[:, None], bsum, 0.0)
    t = u * torch.where(ok, total, 0.0)
    blk = search(bsum, t)
    before = torch.where(blk > 0, bsum.cumsum(-1).gather(1, (blk - 1).clamp_min(0)[:, None]).squeeze(1), 0.0)
    vals, starts = gather_blocks(probs, None, blk[:, None], bs, 0.0)
    vals = torch.where(ok[:, None], vals.to(torch.float64), 0.0)
    j = search(vals, (t - before).clamp_min(0.0))
    return block_columns(starts, j[:, None], bs).squeeze(1), ok


def softmax_rows(x: torch.Tensor, rows: RowGroup, out: torch.Tensor) -> torch.Tensor:
    """``softmax`` of rows ``rows`` of ``x`` into ``out`` [len(rows), V], read in place run by run."""
    for r in rows.runs:
        torch.softmax(x[r.batch : r.batch + r.length], -1, out=out[r.local : r.local + r.length])
    return out


def row_block_sums(probs: torch.Tensor) -> torch.Tensor:
    """[n, nb] float32 mass of each block of each row (the first level of ``draw_rows``)."""
    return block_reduce(probs, block_size(probs.shape[1]), "sum")

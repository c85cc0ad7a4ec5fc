"""Fixed-size column blocks of a [n, V] tensor: per-block reductions and block gathers.

Two-level algorithms (argmax, top-k, inverse CDF) read the whole row once through a cheap block
reduction and then touch only a few blocks. Blocks partition the row; when ``bs`` does not
divide ``V`` the last block is the short tail. Gathering the tail reads the window
``[V - bs, V)`` and masks the part that belongs to the previous block, so no column is seen twice.
"""

from __future__ import annotations

import torch

from worker.ops.plan import RowGroup

BLOCK = 256


def block_size(vocab_size: int, bs: int = BLOCK) -> int:
    return max(1, min(bs, vocab_size))


def num_blocks(vocab_size: int, bs: int) -> int:
    return -(-vocab_size // bs)


def block_reduce(x: torch.Tensor, bs: int, op: str, rows: RowGroup | None = None) -> torch.Tensor:
    """[n, V] -> [n, ceil(V / bs)]: ``op`` ("amax" or "sum") over each block of the row.

    With ``rows``, only those rows of ``x`` (in their order), read in place run by run.
    """
    if rows is None:
        return _block_reduce(x, bs, op)
    out = torch.empty(len(rows), num_blocks(x.shape[1], bs), dtype=x.dtype, device=x.device)
    for run in rows.runs:
        out[run.local : run.local + run.length] = _block_reduce(x[run.batch : run.batch + run.length], bs, op)
    return out


def _block_reduce(x: torch.Tensor, bs: int, op: str) -> torch.Tensor:
    _, v = x.shape
    full = v // bs
    parts = []
    if full:
        parts.append(getattr(x[:, : full * bs].unflatten(1, (full, bs)), op)(-1))
    if v - full * bs:
        parts.append(getattr(x[:, full * bs :], op)(-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def gather_blocks(
    x: torch.Tensor, rows: torch.Tensor | None, blocks: torch.Tensor, bs: int, fill: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values of ``blocks`` [m, j] of rows ``rows`` [m] (all rows when None), and where each block starts.

    Returns ([m, j * bs] values, [m, j] int64 first column of each gathered window); the column
    of a flat position is ``block_columns(starts, pos, bs)``. Tail-window columns that belong to
    the previous block hold ``fill`` (they repeat real columns and must carry no weight).
    """
    n, v = x.shape
    full = v // bs
    starts = blocks * bs
    has_tail = v - full * bs > 0
    if has_tail:
        starts = torch.where(blocks == full, v - bs, starts)
    if x.stride(1) != 1:
        x = x.contiguous()
    if rows is None:
        rows = torch.arange(n, device=x.device)
    # Every window of bs consecutive elements of the storage, one per offset; an index_select of
    # the wanted offsets copies whole windows (a strided advanced index is several times slower).
    s0 = x.stride(0)
    windows = x.as_strided((max(0, (n - 1) * s0 + v - bs + 1), bs), (1, 1))
    vals = torch.index_select(windows, 0, (rows[:, None] * s0 + starts).flatten()).view(*blocks.shape, bs)
    if has_tail:
        before_tail = torch.arange(bs, device=x.device) < full * bs - (v - bs)  # the tail window's repeats
        vals = vals.masked_fill((blocks == full)[..., None] & before_tail, fill)
    return vals.flatten(1), starts


def block_columns(starts: torch.Tensor, pos: torch.Tensor, bs: int) -> torch.Tensor:
    """Column ids of flat positions ``pos`` [m, q] into ``gather_blocks``' values, given its ``starts``."""
    return starts.gather(1, torch.div(pos, bs, rounding_mode="floor")) + pos % bs

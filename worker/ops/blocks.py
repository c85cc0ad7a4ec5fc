"""Fixed-size column blocks of a [n, V] tensor: per-block reductions and block gathers.

Two-level algorithms (argmax, top-k, inverse CDF) read the whole row once through a cheap block
reduction and then touch only a few blocks. Blocks partition the row; when ``bs`` does not
divide ``V`` the last block is the short tail. Gathering the tail reads the window
``[V - bs, V)`` and masks the part that belongs to the previous block, so no column is seen twice.
"""

from __future__ import annotations

import torch

BLOCK = 256


def block_size(vocab_size: int, bs: int = BLOCK) -> int:
    return max(1, min(bs, vocab_size))


def num_blocks(vocab_size: int, bs: int) -> int:
    return -(-vocab_size // bs)


def block_reduce(x: torch.Tensor, bs: int, op: str) -> torch.Tensor:
    """[n, V] -> [n, ceil(V / bs)]: ``op`` ("amax" or "sum") over each block of the row."""
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
    """Values and column ids of ``blocks`` [m, j] of rows ``rows`` [m] (all rows when None).

    Returns ([m, j * bs] values, [m, j * bs] int64 ids); tail-window columns that belong to the
    previous block hold ``fill`` (their ids repeat real columns and must carry no weight).
    """
    n, v = x.shape
    full = v // bs
    starts = blocks * bs
    has_tail = v - full * bs > 0
    if has_tail:
        starts = torch.where(blocks == full, v - bs, starts)
    windows = x.as_strided((n, v - bs + 1, bs), (x.stride(0), x.stride(1), x.stride(1)))
    if rows is None:
        rows = torch.arange(n, device=x.device)
    vals = windows[rows[:, None], starts]  # [m, j, bs]
    ids = starts[..., None] + torch.arange(bs, device=x.device)
    if has_tail:
        overlap = (blocks == full)[..., None] & (ids < full * bs)
        vals = vals.masked_fill(overlap, fill)
    return vals.flatten(1), ids.flatten(1)

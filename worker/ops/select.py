"""Exact selection on rows: first-occurrence argmax and top-k with ties toward lower ids.

Both read the row once through block maxima (``blocks.py``) and then look at a few blocks, so a
[B, V] selection costs about one read pass instead of a sort or a per-row heap over V.

Top-k is two-phase so the sampler can batch its host reads: ``topk_candidates`` returns the
exact top-(k+1) values with arbitrary ids among ties; a row is *ambiguous* when ties straddle
the k-th place (``vals[k-1] == vals[k]``), and only those rows go through ``topk_lowest_ids``,
which picks the lowest ids among the tied values with one exact full-row pass.
"""

from __future__ import annotations

import torch

from worker.ops.blocks import block_columns, block_reduce, block_size, gather_blocks, num_blocks
from worker.ops.host_sync import host_lists
from worker.ops.plan import RowGroup
from worker.ops.staging import to_device


def row_argmax(
    x: torch.Tensor, bmax: torch.Tensor | None = None, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] max values, [n] int64 ids) of rows ``rows`` of ``x`` (all when None); the lowest id
    wins a tie. NaN rows: NaN value.

    ``bmax`` may pass ``block_reduce(x, block_size(V), "amax")`` (every row of ``x``) when the
    caller already has it; then only the winning block of each row is read.
    """
    _, v = x.shape
    bs = block_size(v)
    if bmax is None:
        bmax = block_reduce(x, bs, "amax")
    if rows is not None:
        bmax = bmax.index_select(0, rows)
    best = torch.argmax(bmax, dim=-1, keepdim=True)  # first block holding the row max
    vals, starts = gather_blocks(x, rows, best, bs, float("-inf"))
    j = torch.argmax(vals, dim=-1, keepdim=True)  # first occurrence inside that block
    return vals.gather(1, j).squeeze(1), block_columns(starts, j, bs).squeeze(1)


def topk_candidates(x: torch.Tensor, k: int, rows: RowGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top-min(k+1, V) values of rows ``rows`` of ``x`` (all when None), sorted descending.

    Ids among equal values are arbitrary; see ``ambiguous``. Proof sketch of exactness: the
    blocks holding any of the top-m values have block max >= the m-th value, and the m blocks
    with the largest maxima contain m values >= it, so the top-m blocks hold the top-m values.
    ``rows`` are read in place, run by run (``plan.Run``): no gathered copy of them is made.
    """
    _, v = x.shape
    m = min(k + 1, v)
    bs = block_size(v)
    if 4 * m * bs > v:  # few blocks: a plain topk is as cheap
        if rows is None:
            return torch.topk(x, m, dim=-1)
        vals = torch.empty(len(rows), m, dtype=x.dtype, device=x.device)
        ids = torch.empty(len(rows), m, dtype=torch.int64, device=x.device)
        for r in rows.runs:
            sl = slice(r.local, r.local + r.length)
            torch.topk(x[r.batch : r.batch + r.length], m, dim=-1, out=(vals[sl], ids[sl]))
        return vals, ids
    bmax = block_reduce(x, bs, "amax", rows)
    top_blocks = torch.topk(bmax, min(m, num_blocks(v, bs)), dim=-1).indices
    vals, starts = gather_blocks(x, None if rows is None else rows.index, top_blocks, bs, float("-inf"))
    top, j = torch.topk(vals, m, dim=-1)
    return top, block_columns(starts, j, bs)


def ambiguous(vals: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[n] bool: ties straddle place ``k`` (per-row [n] int64, >= 1) of the sorted candidates ``vals``.

    A row whose ``k`` covers every candidate column has no next value and is never ambiguous.
    """
    m = vals.shape[1]
    kth = vals.gather(1, (k - 1).clamp(max=m - 1)[:, None]).squeeze(1)
    nxt = vals.gather(1, k.clamp(max=m - 1)[:, None]).squeeze(1)
    return (kth == nxt) & (k < m)


def topk_lowest_ids(x: torch.Tensor, kth: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of rows ``x`` [a, V] given each row's k-th value ``kth`` [a]: ties -> lowest ids.

    Ranks every column by (class, -id) with class 2 above ``kth``, 1 equal, 0 below; the scores
    are distinct integers, so ``topk`` has no ties left to break.
    """
    _, v = x.shape
    t = kth[:, None]
    cls = (x > t).to(torch.int64) * 2 + (x == t).to(torch.int64)
    score = cls * (v + 1) + (v - torch.arange(v, device=x.device))
    ids = torch.topk(score, k, dim=-1).indices
    return x.gather(1, ids), ids


def sort_by_value_then_id(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of candidates ordered by value descending, equal values by id ascending."""
    o = torch.argsort(ids, dim=-1, stable=True)
    vals, ids = vals.gather(1, o), ids.gather(1, o)
    o = torch.argsort(vals, dim=-1, descending=True, stable=True)
    return vals.gather(1, o), ids.gather(1, o)


def resolve_topk(
    x: torch.Tensor,
    vals: torch.Tensor,
    ids: torch.Tensor,
    k: torch.Tensor,
    kmax: int,
    ambiguous_rows: list[int],
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2: the exact top-``kmax`` columns of candidates ``vals``/``ids`` from ``topk_candidates(x, kmax)``.

    ``k`` [n] is each row's own k (columns at or past it are the caller's to ignore);
    ``ambiguous_rows`` (host list, from ``ambiguous``) are recomputed with ``topk_lowest_ids``;
    ``rows`` maps candidate rows to rows of ``x`` as in ``topk_candidates``.
    """
    vals, ids = vals[:, :kmax].clone(), ids[:, :kmax].clone()
    if ambiguous_rows:
        loc = to_device(ambiguous_rows, torch.int64, x.device)
        kth = vals.gather(1, (k - 1)[:, None]).squeeze(1)[loc]
        fv, fi = topk_lowest_ids(x.index_select(0, loc if rows is None else rows[loc]), kth, kmax)
        vals[loc], ids[loc] = fv, fi
    return vals, ids


def exact_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot exact top-k of every row (one host read, for the tie flags): sorted by value desc, ties by id asc."""
    n, v = x.shape
    k = min(k, v)
    vals, ids = topk_candidates(x, k)
    kk = torch.full((n,), k, dtype=torch.int64, device=x.device)
    (tied,) = host_lists(ambiguous(vals, kk), label="exact_topk ties")
    amb = [i for i, t in enumerate(tied) if t]
    return sort_by_value_then_id(*resolve_topk(x, vals, ids, kk, k, amb))

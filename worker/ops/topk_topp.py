"""Top-p (nucleus) selection, exact, without sorting the vocabulary.

Rule (docs/sampling.md "The nine steps" 7c): order tokens by probability descending, equal probabilities by id
ascending; keep the shortest prefix whose mass reaches ``p`` times the row's total mass. A
token is kept iff the mass strictly before it is below that target, so the top token always
survives and zero-probability tokens never do (for ``p < 1``).

Three ways to apply it, all giving that rule:
- ``top_p_keep``: on candidate lists already in that order (top-k rows, probe hits).
- ``top_p_probe``: the top-64 of a full row; decides the row when its nucleus ends inside them.
- ``top_p_histogram_``: a mass histogram over the float bits of the probabilities (monotone
  for non-negative floats) finds the bucket where the target mass is crossed; only that
  bucket's tokens are sorted. Everything below it is zeroed in place.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import torch

from worker.ops.draw import row_total
from worker.ops.flat import put2d_, take2d
from worker.ops.host_sync import host_lists
from worker.ops.scratch import Buffer
from worker.ops.select import sort_by_value_then_id, topk_candidates

PROBE = 64
_SHIFT = 16  # bucket = sign, exponent and 7 mantissa bits: buckets 2^-7 (0.8 %) wide
_NUM_BUCKETS = (0x3F800000 >> _SHIFT) + 1  # probabilities lie in [0, 1.0]


def top_p_keep(probs: torch.Tensor, p: torch.Tensor, target_total: torch.Tensor | None = None) -> torch.Tensor:
    """[n, m] bool kept mask for candidate probabilities ``probs`` [n, m] already in top-p order.

    ``p`` [n] float64 (rows with p >= 1 keep everything); the target is ``p * total`` where the
    total is the candidates' own mass unless ``target_total`` [n] is given.
    """
    cs = probs.to(torch.float64).cumsum(-1)
    excl = torch.cat([torch.zeros_like(cs[:, :1]), cs[:, :-1]], dim=-1)
    total = cs[:, -1] if target_total is None else target_total
    return (excl < (p * total)[:, None]) | (p >= 1.0)[:, None]


def top_p_probe(
    probs: torch.Tensor, p: torch.Tensor, totals: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Try to settle top-p of full rows ``probs`` [h, V] from their top-``PROBE`` tokens.

    Returns (ids [h, c], probs [h, c] in top-p order, keep [h, c], hit [h]). Where ``hit``, the
    kept candidates are exactly the row's nucleus: the prefix reaches the target, and its last
    value is above the best value left out, so every token tied with it is among the candidates.
    """
    h, v = probs.shape
    c = min(PROBE, v)
    vals, ids = topk_candidates(probs, c)
    best_left_out = vals[:, c] if vals.shape[1] > c else torch.full((h,), -1.0, device=probs.device)
    vals, ids = sort_by_value_then_id(vals[:, :c], ids[:, :c])
    keep = top_p_keep(vals, p, totals)
    reached = row_total(vals.to(torch.float64)) >= p * totals
    last = vals.gather(1, (keep.sum(-1) - 1).clamp_min(0)[:, None]).squeeze(1)
    return ids, vals, keep, reached & (last > best_left_out)


@dataclass
class TopPScratch:
    """``top_p_histogram_``'s temporaries, [h, V] each but ``hist`` ([h, buckets]) and ``spread`` ([1, V])."""

    key32: Buffer = field(default_factory=Buffer)  # int32 bucket of each token
    key: Buffer = field(default_factory=Buffer)  # the same as int64 (scatter_add's fast path wants them)
    mass: Buffer = field(default_factory=Buffer)  # float64 probabilities
    hist: Buffer = field(default_factory=Buffer)
    in_bucket: Buffer = field(default_factory=Buffer)  # bool, rows padded to a multiple of 8 columns
    _spread: torch.Tensor | None = field(default=None, init=False, repr=False)

    def spread(self, v: int, device: torch.device) -> torch.Tensor:
        """[1, V] int32 ``column & 127``: the buckets that zero probabilities are spread over."""
        if self._spread is None or self._spread.shape[1] != v or self._spread.device != device:
            self._spread = (torch.arange(v, dtype=torch.int32, device=device) & 127)[None, :]
        return self._spread


def top_p_histogram_(probs: torch.Tensor, p: torch.Tensor, scratch: TopPScratch) -> None:
    """Zero, in place, every token of rows ``probs`` [h, V] (finite, >= 0) outside the nucleus."""
    h, v = probs.shape
    dev = probs.device
    key32 = torch.bitwise_right_shift(probs.view(torch.int32), _SHIFT, out=scratch.key32.take((h, v), torch.int32, dev))
    # Zero (and subnormal) probabilities would all hit bucket 0, a chain of dependent adds that
    # costs more than the rest of the scatter; spread them over buckets 0-127 (which hold only
    # mass < 2^-126, never a boundary) by column.
    torch.maximum(key32, scratch.spread(v, dev), out=key32)
    key = scratch.key.take((h, v), torch.int64, dev)
    key.copy_(key32)
    # Masses in float64, as the reference sums them: a float32 bucket of thousands of equal
    # probabilities drifts by 1e-4 relative, enough to move the cut.
    mass = scratch.mass.take((h, v), torch.float64, dev)
    mass.copy_(probs)
    hist = scratch.hist.take((h, _NUM_BUCKETS), torch.float64, dev).zero_()
    hist.scatter_add_(1, key, mass)
    from_top = hist.flip(-1).cumsum(-1)  # mass of every bucket >= this one
    target = p * from_top[:, -1]
    r = torch.searchsorted(from_top, target[:, None]).clamp_max(_NUM_BUCKETS - 1)  # first reaching it
    bucket = (_NUM_BUCKETS - 1) - r  # [h, 1]
    above = torch.where(r > 0, from_top.gather(1, (r - 1).clamp_min(0)), 0.0).squeeze(1)

    # The boundary bucket's tokens, in top-p order within each row.
    row, col = _equal_positions(key32, bucket.to(torch.int32), scratch.in_bucket)
    val = take2d(probs, row, col)
    o = torch.argsort(val, descending=True, stable=True)  # positions come (row, col) ascending
    row, col, val = row[o], col[o], val[o]
    o = torch.argsort(row, stable=True)
    row, col, val = row[o], col[o], val[o]
    # Each row's running sum on its own (a [h, max count] padded matrix), so a row's cut never
    # depends on the other rows' candidates.
    counts = torch.bincount(row, minlength=h)
    # One host read: the padded matrix's width, and each row's bucket (for the cut below it).
    (flat,) = host_lists(torch.cat([counts.max()[None], bucket.flatten()]), label="top-p histogram")
    width, *buckets = flat
    pos = torch.arange(row.numel(), device=row.device) - (torch.cumsum(counts, 0) - counts)[row]
    padded = torch.zeros(h, width + 1, dtype=torch.float64, device=dev)
    put2d_(padded, row, pos + 1, val.to(torch.float64))
    before = take2d(padded.cumsum(1), row, pos)  # mass of the row's earlier candidates
    drop = above[row] + before >= target[row]
    put2d_(probs, row[drop], col[drop], 0.0)

    # Everything in a lower bucket: values below the bucket's smallest float. ``threshold_``
    # keeps x > the float just under it, in one pass (a 0/1 mask and a multiply take three).
    for i, b in enumerate(buckets):
        if b > 0:  # bucket 0 starts at 0.0: nothing lies below it
            torch.threshold_(probs[i], _float_bits((b << _SHIFT) - 1), 0.0)


def _float_bits(bits: int) -> float:
    """The float32 whose bit pattern is ``bits`` (non-negative)."""
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _equal_positions(key: torch.Tensor, value: torch.Tensor, scratch: Buffer) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols), ascending, where ``key`` [h, V] equals ``value`` [h, 1]: a few per row.

    ``nonzero`` of the [h, V] mask costs about two passes over it; the mask's bytes read as int64
    words are 8 times fewer, so this finds the non-zero words and looks inside those only.
    """
    h, v = key.shape
    padded = -(-v // 8) * 8
    buf = scratch.take((h, padded), torch.bool, key.device)
    buf[:, v:] = False
    mask = buf[:, :v]
    torch.eq(key, value, out=mask)
    row, word = buf.view(torch.int64).nonzero(as_tuple=True)
    cols = (word[:, None] * 8 + torch.arange(8, device=key.device)).flatten()
    rows = row.repeat_interleave(8)
    hit = take2d(buf, rows, cols)
    return rows[hit], cols[hit]

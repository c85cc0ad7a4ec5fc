"""The non-finite rules (docs/sampling.md "Non-finite values") on a batch of processed logits,
cheap when every row is finite.

``+inf`` is a legal way to force a token (vLLM's examples do it): the limit of softmax puts all
the mass on the ``+inf`` tokens, uniformly. NaN is never a distribution: the row fails.
"""

from __future__ import annotations

import torch

from worker.ops.blocks import block_reduce, block_size

_NEG_INF = float("-inf")
_POS_INF = float("inf")


def resolve_non_finite_(x: torch.Tensor, bmax: torch.Tensor | None = None) -> torch.Tensor | None:
    """The non-finite rules (docs/sampling.md "Non-finite values"), in place on the rows that need
    them; [B] bool NaN rows or None.

    A row holding ``+inf`` becomes 0 at its ``+inf`` tokens and -inf elsewhere (the limit of
    softmax: greedy takes the lowest such id, a draw is uniform among them). A row holding NaN
    becomes all zeros (a harmless stand-in: its token is discarded) and is flagged. Cost in the
    common case: one max over ``bmax`` (the block maxima, when the caller has them; NaN
    propagates through max) or over ``x``, and one host read. A None return leaves ``x`` (and
    ``bmax``) untouched; otherwise ``bmax`` is brought up to date for the rewritten rows.
    """
    top = float((bmax if bmax is not None else x).max())  # NaN if any NaN, else inf if any +inf
    if top == top and top != _POS_INF:
        return None
    m = (bmax if bmax is not None else x).amax(-1)
    special = torch.isnan(m) | torch.isposinf(m)
    rows = special.nonzero().flatten()
    sub = x.index_select(0, rows)
    nan = torch.isnan(sub).any(-1)
    forced = torch.where(torch.isposinf(sub), 0.0, _NEG_INF)
    new = torch.where(nan[:, None], 0.0, forced)
    x.index_copy_(0, rows, new)
    if bmax is not None:
        bmax.index_copy_(0, rows, block_reduce(new, block_size(x.shape[1]), "amax"))
    nan_rows = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    nan_rows[rows] = nan
    return nan_rows

"""The non-finite rules (docs/sampling.md "Non-finite values") on a batch of processed logits,
vectorised and without a host read.

``+inf`` is a legal way to force a token (vLLM's examples do it): the limit of softmax puts all
the mass on the ``+inf`` tokens, uniformly. NaN is never a distribution: the row fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.ops.host_sync import cpu_all


@dataclass(frozen=True)
class NonFinite:
    """Per row of a batch: whether it held NaN, and the two per-row constants of the rewrite."""

    nan: torch.Tensor  # [B] bool: the row held NaN (it fails)
    shift: torch.Tensor  # [B, 1]: 0, +inf on rows holding +inf, NaN on rows holding NaN
    cap: torch.Tensor  # [B, 1]: +inf, 0 on those rows
    # Known on the host that no row holds NaN or +inf (only ever set on the CPU, where looking is
    # no sync): the rewrite is then the identity and is skipped.
    clean: bool = False

    def index_select(self, rows: torch.Tensor) -> NonFinite:
        return NonFinite(self.nan[rows], self.shift[rows], self.cap[rows], self.clean)


def non_finite_rows(bmax: torch.Tensor) -> NonFinite:
    """The rows' flags from ``bmax`` [B, nb]: their block maxima (or the rows themselves); NaN
    propagates through max, so a row's maximum is NaN if it holds one, else +inf if it holds one.

    On the CPU the common case (every maximum below +inf, which NaN is not) is looked at first:
    there the rewrite's two passes over [B, V] would cost more than the rest of a temperature call.
    """
    m = bmax.amax(-1, keepdim=True)
    if m.device.type == "cpu" and cpu_all(m < float("inf")):
        return NonFinite(
            torch.zeros(m.shape[0], dtype=torch.bool), torch.zeros_like(m), torch.full_like(m, float("inf")), True
        )
    nan, posinf = torch.isnan(m), torch.isposinf(m)
    shift = torch.where(nan, float("nan"), torch.where(posinf, float("inf"), 0.0)).to(bmax.dtype)
    cap = torch.where(nan | posinf, 0.0, float("inf")).to(bmax.dtype)
    return NonFinite(nan.squeeze(1), shift, cap)


def resolve_non_finite_(x: torch.Tensor, nf: NonFinite) -> None:
    """The rules, in place on every row of ``x`` [B, n] (logits, or their block maxima).

    A row holding ``+inf`` becomes 0 at its ``+inf`` tokens and -inf elsewhere (greedy takes the
    lowest such id, a draw is uniform among them); a row holding NaN becomes all zeros (a
    harmless stand-in: its token is discarded). Two branch-free passes, ``fmin(x - shift, cap)``:
    on a row holding +inf, ``inf - inf`` is NaN and ``fmin`` turns NaN into the cap 0 while every
    finite value went to -inf; on a NaN row everything is NaN, then 0; elsewhere ``x - 0`` and
    ``fmin(x, inf)`` are exactly ``x``. The block maxima of the result are this applied to the
    block maxima.
    """
    if nf.clean:
        return
    x.sub_(nf.shift)
    torch.fmin(x, nf.cap, out=x)

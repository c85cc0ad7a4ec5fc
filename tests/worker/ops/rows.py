"""Designed logit rows for the ops tests: ties, one peak over a flat floor, -inf holes, normals."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def logit_rows(draw: st.DrawFn, n: int, v: int, allow_neg_inf: bool = True) -> torch.Tensor:
    """[n, v] float32 rows mixing the hard cases: many equal values, a single peak, -inf holes."""
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["ties", "peak", "normal", "few_levels"]))
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        x = torch.zeros(n, v)
    elif kind == "peak":
        x = torch.zeros(n, v)
        x[torch.arange(n), torch.randint(0, v, (n,), generator=g)] = 3.0
    elif kind == "few_levels":
        x = torch.randint(-2, 3, (n, v), generator=g).float()
    else:
        x = torch.randn(n, v, generator=g)
    if allow_neg_inf and draw(st.booleans()):
        holes = torch.rand(n, v, generator=g) < 0.3
        x = x.masked_fill(holes, float("-inf"))
        x[:, 0] = torch.where(torch.isinf(x[:, 0]), 0.0, x[:, 0])  # keep a finite logit per row
    return x

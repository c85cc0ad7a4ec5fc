"""Inverse-CDF draws: exact in distribution (chi-square), never a zero-weight token, seeded rows alone."""

from __future__ import annotations

import torch

from tests.worker.sampler_reference import chi2_pvalue as _chi2_pvalue
from worker.ops.draw import draw_rows, draw_weights, uniforms

P_MIN = 1e-3  # chi-square p-value below which a test fails (seeded, so not flaky)


def test_draw_rows_matches_weights_across_blocks_and_tail() -> None:
    g = torch.Generator().manual_seed(0)
    v = 600  # blocks of 256, 256 and a tail of 88
    w = torch.rand(v, generator=g) ** 4
    w[::7] = 0.0
    w[590:] = 0.05  # mass in the tail block
    n = 20000
    u = torch.rand(n, dtype=torch.float64, generator=g)
    tokens, ok = draw_rows(w.expand(n, v).contiguous(), u)
    assert ok.all()
    assert _chi2_pvalue(tokens, w) > P_MIN


def test_draw_weights_matches_weights() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.0, 0.125])
    n = 20000
    col, ok = draw_weights(w.expand(n, -1), torch.rand(n, dtype=torch.float64, generator=g))
    assert ok.all()
    assert _chi2_pvalue(col, w) > P_MIN


def test_extreme_uniforms_land_on_positive_weights() -> None:
    w = torch.zeros(3, 700)
    w[:, 5] = 1.0
    w[:, 600] = 2.0  # the last positive weight, in the tail block
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5], dtype=torch.float64)
    tokens, ok = draw_rows(w, u)
    assert ok.all()
    assert tokens.tolist() == [5, 600, 600]
    col, _ = draw_weights(w[:, :610], u)
    assert col.tolist() == [5, 600, 600]


def test_rows_without_mass_are_flagged() -> None:
    w = torch.ones(3, 300)
    w[0] = 0.0
    w[1, 3] = float("nan")
    tokens, ok = draw_rows(w, torch.full((3,), 0.5, dtype=torch.float64))
    assert ok.tolist() == [False, False, True]
    assert ((tokens >= 0) & (tokens < 300)).all()
    _, ok2 = draw_weights(w, torch.full((3,), 0.5, dtype=torch.float64))
    assert ok2.tolist() == [False, False, True]


def test_seeded_rows_draw_once_from_their_own_generator() -> None:
    alone = uniforms([0], {0: torch.Generator().manual_seed(7)}, torch.Generator().manual_seed(1), torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    inside = uniforms([4, 9, 2], {9: g}, torch.Generator().manual_seed(2), torch.device("cpu"))
    assert inside[1].item() == alone[0].item()
    second = uniforms([9], {9: g}, None, torch.device("cpu"))
    assert second[0].item() == torch.rand(2, dtype=torch.float64, generator=torch.Generator().manual_seed(7))[1].item()
    assert inside.dtype == torch.float64 and ((inside >= 0) & (inside < 1)).all()

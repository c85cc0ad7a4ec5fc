"""Top-p three ways (candidates, probe, histogram) against the sort-everything reference."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.worker.sampler_reference import logit_rows, order, top_p_kept, top_p_margin
from worker.ops.topk_topp import TopPScratch, top_p_histogram_, top_p_keep, top_p_probe

P_VALUES = [0.05, 0.3, 0.5, 0.9, 0.99]


def _probs(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([8, 64, 300, 3000]), st.sampled_from(P_VALUES))
def test_histogram_keeps_exactly_the_nucleus(data: st.DataObject, v: int, p: float) -> None:
    x = data.draw(logit_rows(3, v))
    for r in range(3):
        assume(top_p_margin(x[r], p) > 1e-5)
    probs = _probs(x)
    before = probs.clone()
    top_p_histogram_(probs, torch.full((3,), p, dtype=torch.float64), TopPScratch())
    for r in range(3):
        kept = sorted(top_p_kept(x[r], p))
        assert (probs[r] > 0).nonzero().flatten().tolist() == [t for t in kept if before[r, t] > 0]
        assert torch.equal(probs[r, kept], before[r, kept])  # kept values untouched


def test_histogram_tie_group_split_by_id() -> None:
    # 10 equal tokens of 0.1 each: p = 0.35 keeps the four lowest ids (mass before the 4th is 0.3).
    probs = torch.full((1, 10), 0.1)
    top_p_histogram_(probs, torch.tensor([0.35], dtype=torch.float64), TopPScratch())
    assert (probs[0] > 0).nonzero().flatten().tolist() == [0, 1, 2, 3]


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([8, 64, 300, 3000]), st.sampled_from(P_VALUES))
def test_probe_hits_are_exact(data: st.DataObject, v: int, p: float) -> None:
    x = data.draw(logit_rows(3, v))
    for r in range(3):
        assume(top_p_margin(x[r], p) > 1e-5)
    probs = _probs(x)
    totals = probs.double().sum(-1)
    ids, _vals, keep, hit = top_p_probe(probs, torch.full((3,), p, dtype=torch.float64), totals)
    for r in range(3):
        kept = top_p_kept(x[r], p)
        if hit[r]:
            assert ids[r][keep[r]].tolist() == kept
        if len(kept) > 64:
            assert not hit[r]


def test_probe_misses_a_flat_row_and_hits_a_peaked_one() -> None:
    x = torch.zeros(2, 3000)
    x[1, 17] = 20.0
    probs = _probs(x)
    _, _, _, hit = top_p_probe(probs, torch.tensor([0.9, 0.9], dtype=torch.float64), probs.double().sum(-1))
    assert hit.tolist() == [False, True]


def test_keep_rule_on_sorted_candidates() -> None:
    q = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]])
    p = torch.tensor([0.5, 1.0, 0.6], dtype=torch.float64)
    keep = top_p_keep(q, p)
    # Row 0: the mass before the 2nd is 0.5, not below 0.5 * 1.0 -> only the top. Row 1: p = 1 keeps all.
    assert keep.tolist() == [[True, False, False, False], [True] * 4, [True, True, True, False]]
    assert order(torch.tensor([1.0, 2.0, 2.0])) == [1, 2, 0]

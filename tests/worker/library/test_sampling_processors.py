"""XTC and mirostat v2: the processors that draw or learn, against llama.cpp's per-row rules.

XTC's coin comes from the request's own stream when it is seeded, so its outputs do not depend
on the batch; mirostat's ``mu`` follows the tokens read back from the live output list.
"""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.library import references as ref
from tests.worker.library.batch import CPU, add_all, random_logits
from worker.logits_processor.interface import BatchUpdate, MoveDirectionality
from worker.logits_processor.library import MirostatLogitsProcessor, XTCLogitsProcessor
from worker.logits_processor.library.xtc import coin_generator
from worker.sampling_params import SamplingParams

V = 32


def _xtc(threshold: float, probability: float, seed: int | None) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, extra_args={"xtc_threshold": threshold, "xtc_probability": probability}
    )


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.01, 0.6), st.floats(0.0, 1.0), st.integers(0, 2**40)), min_size=1, max_size=5),
    st.integers(0, 2**16),
)
def test_xtc_seeded_rows_match_llama_cpp(rows: list[tuple[float, float, int]], seed: int) -> None:
    proc = XTCLogitsProcessor(None, CPU, False)
    add_all(proc, [_xtc(t, p, s) for t, p, s in rows], [[] for _ in rows], [[] for _ in rows])
    coins = [coin_generator(s) for _, _, s in rows]
    for step in range(4):
        logits = random_logits(seed + step, len(rows), V, scale=2.0)
        out = proc.apply(logits.clone())
        for i, (t, p, _) in enumerate(rows):
            chance = torch.rand(1, dtype=torch.float64, generator=coins[i]).item() if p > 0 and t <= 0.5 else 1.0
            torch.testing.assert_close(out[i], ref.xtc(logits[i], t, p, chance), rtol=0, atol=0)


def test_xtc_seeded_request_is_independent_of_its_batch() -> None:
    """The same seeded request, alone and among other (seeded and unseeded) rows, at another row."""
    target = _xtc(0.05, 0.5, seed=1234)
    logits = random_logits(7, 1, V, scale=1.0)[0]

    def run(others: int, row: int) -> list[torch.Tensor]:
        proc = XTCLogitsProcessor(None, CPU, False)
        params = [_xtc(0.05, 0.5, seed=i if i % 2 else None) for i in range(others)]
        params.insert(row, target)
        add_all(proc, params, [[] for _ in params], [[] for _ in params])
        outs = []
        for _ in range(12):
            x = torch.randn(len(params), V)
            x[row] = logits
            outs.append(proc.apply(x)[row].clone())
        return outs

    alone = run(0, 0)
    crowded = run(5, 3)
    assert all(torch.equal(a, b) for a, b in zip(alone, crowded))
    assert any(not torch.equal(a, logits) for a in alone) and any(torch.equal(a, logits) for a in alone)


def test_xtc_unseeded_fires_at_its_probability() -> None:
    proc = XTCLogitsProcessor(None, CPU, False)
    n = 400
    add_all(proc, [_xtc(0.1, 0.3, None)] * n, [[]] * n, [[]] * n)
    logits = torch.full((n, V), -5.0)
    logits[:, :3] = 0.0  # three top choices of p ~ 1/3 each
    fired = (proc.apply(logits) == float("-inf")).any(-1).float().mean().item()
    assert 0.22 < fired < 0.38


def test_xtc_leaves_greedy_rows_alone() -> None:
    proc = XTCLogitsProcessor(None, CPU, False)
    greedy = SamplingParams(temperature=0.0, extra_args={"xtc_threshold": 0.1, "xtc_probability": 1.0})
    add_all(proc, [greedy], [[]], [[]])
    x = torch.zeros(1, V)
    assert proc.apply(x) is x and torch.equal(x, torch.zeros(1, V))


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.5, 6.0), st.floats(0.0, 1.0)), min_size=1, max_size=4),
    st.integers(0, 2**16),
)
def test_mirostat_v2_follows_llama_cpp_step_by_step(rows: list[tuple[float, float]], seed: int) -> None:
    """Masks every step and the learnt mu, with tokens drawn from the kept set (read back live)."""
    rng = random.Random(seed)
    proc = MirostatLogitsProcessor(None, CPU, False)
    outputs: list[list[int]] = [[] for _ in rows]
    params = [
        SamplingParams(temperature=0.8, extra_args={"mirostat": 2, "mirostat_tau": t, "mirostat_eta": e})
        for t, e in rows
    ]
    add_all(proc, params, [[] for _ in rows], outputs)
    mu = [2 * t for t, _ in rows]
    for step in range(6):
        logits = random_logits(seed + step, len(rows), V, scale=2.5)
        out = proc.apply(logits.clone())
        proc.update_state(None)
        for i, (tau, eta) in enumerate(rows):
            expected = ref.mirostat_step(logits[i], mu[i])
            torch.testing.assert_close(out[i], expected, rtol=0, atol=0)
            kept = torch.isfinite(expected).nonzero().flatten().tolist()
            tok = rng.choice(kept) if kept else 0
            if kept:
                mu[i] = ref.mirostat_update(expected, tok, mu[i], tau, eta)
            outputs[i].append(tok)
    proc.apply(random_logits(seed, len(rows), V))  # reads the last tokens
    for i in range(len(rows)):
        assert abs(proc.states[i].mu - mu[i]) < 1e-4 * max(1.0, abs(mu[i]))


def test_mirostat_state_follows_its_row_through_a_swap() -> None:
    proc = MirostatLogitsProcessor(None, CPU, False)
    outs: list[list[int]] = [[], []]
    p = [SamplingParams(temperature=1.0, extra_args={"mirostat": 2, "mirostat_tau": tau}) for tau in (1.0, 8.0)]
    add_all(proc, p, [[], []], outs)
    proc.apply(random_logits(1, 2, V))
    outs[0].append(0)
    outs[1].append(0)
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[(0, 1, MoveDirectionality.SWAP)], added=[]))
    proc.apply(random_logits(2, 2, V))
    assert proc.states[0].tau == 8.0 and proc.states[1].tau == 1.0

"""The non-finite rules (docs/sampling.md "Non-finite values") in the batched Sampler, against a
plain per-row reference: +inf forces (greedy: lowest id; random: uniform, exactly), all -inf and
NaN fail their row alone with distinct messages, and rows without a special value are not affected."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker import sampler_reference as ref
from tests.worker.sampler_reference import logit_rows
from tests.worker.test_sampler import P_MIN, _random_params, batch, sample
from worker.sampler import NAN_LOGITS, NO_FINITE_LOGIT, Sampler
from worker.sampling_params import SamplingParams

INF = float("inf")


def reference_outcome(row: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]):
    """("nan",) | ("excluded",) | ("greedy", token) | ("support", kept ids or None when too close to call)."""
    x = ref.before_temperature(row, params, prompt, output)
    if torch.isnan(x).any():
        return ("nan",)
    if torch.isposinf(x).any():
        x = torch.where(torch.isposinf(x), 0.0, -INF)
    if not torch.isfinite(x).any():
        return ("excluded",)
    if params.is_greedy:
        return ("greedy", ref.greedy_token(x))
    x = x / torch.tensor(params.temperature, dtype=torch.float32)
    x = ref.top_k(ref.min_p(x, params.min_p), params.top_k)
    p = float(torch.tensor(params.top_p, dtype=torch.float32))
    if p < 1.0 and ref.top_p_margin(x, p) < 1e-5:
        return ("support", None)
    x = ref.top_p(x, p)
    return ("support", set(torch.nonzero(torch.softmax(x, -1) > 0).flatten().tolist()))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6), v=st.sampled_from([40, 3000]))
def test_non_finite_rows_match_the_reference(data: st.DataObject, seed: int, n: int, v: int) -> None:
    rng = random.Random(seed)
    params = [_random_params(rng, v) for _ in range(n)]
    prompts = [[rng.randrange(v) for _ in range(3)] for _ in params]
    outputs = [[rng.randrange(v) for _ in range(rng.randint(0, 3))] for _ in params]
    x = data.draw(logit_rows(n, v))
    for i in range(n):
        kind = data.draw(st.sampled_from(["finite", "posinf", "posinf", "nan", "neginf"]))
        cols = data.draw(st.lists(st.integers(0, v - 1), min_size=1, max_size=5))
        if kind == "posinf":
            x[i, cols] = INF
        elif kind == "nan":
            x[i, cols[0]] = float("nan")
        elif kind == "neginf":
            x[i] = -INF
    out = sample(params, x, seed=seed, prompts=prompts, outputs=outputs)
    tokens = out.sampled_token_ids.tolist()
    for i, p in enumerate(params):
        expect = reference_outcome(x[i], p, prompts[i], outputs[i])
        if expect[0] == "nan":
            assert out.errors[i] and out.error_messages[i].startswith(NAN_LOGITS) and tokens[i] == -1
        elif expect[0] == "excluded":
            assert out.errors[i] and out.error_messages.get(i, NO_FINITE_LOGIT) == NO_FINITE_LOGIT and tokens[i] == -1
        else:
            assert not out.errors[i] and i not in out.error_messages
            if expect[0] == "greedy":
                assert tokens[i] == expect[1]
            elif expect[1] is not None:
                assert tokens[i] in expect[1]
        if out.logprobs is not None and not out.errors[i]:
            k = p.logprobs if p.logprobs is not None else -1
            assert not torch.isnan(out.logprobs.logprobs[i, : k + 1]).any()


def _forced(v: int, ids: list[int], n: int) -> torch.Tensor:
    x = torch.randn(n, v, generator=torch.Generator().manual_seed(v))
    x[:, ids] = INF
    return x


def test_forced_greedy_takes_the_lowest_plus_inf_id() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=1)]
    out = sample(params, _forced(300, [250, 17, 90], 2))
    assert out.sampled_token_ids.tolist() == [17, 17]


def test_forced_random_draw_is_uniform_chi_square() -> None:
    v, ids, n = 3000, [3, 100, 101, 1500, 2999], 4000
    tokens = sample([SamplingParams(temperature=1.3)] * n, _forced(v, ids, n), seed=5).sampled_token_ids
    uniform = torch.zeros(v, dtype=torch.float64)
    uniform[ids] = 1.0
    assert ref.chi2_pvalue(tokens, uniform) > P_MIN


def test_forced_seeded_rows_use_their_own_generator_uniformly() -> None:
    """Seeded forced rows: batch-invariant (own generator), and uniform across seeds."""
    v, ids = 300, [7, 8, 200]
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(1500)]
    x = _forced(v, ids, len(params))
    batched = sample(params, x, seed=1).sampled_token_ids
    for i in (0, 17, 999):
        assert sample([params[i]], x[i : i + 1], seed=99).sampled_token_ids.item() == batched[i].item()
    uniform = torch.zeros(v, dtype=torch.float64)
    uniform[ids] = 1.0
    assert ref.chi2_pvalue(batched, uniform) > P_MIN


def test_forced_rows_leave_their_neighbours_alone() -> None:
    v = 300
    x = torch.randn(3, v, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.9, seed=1, logprobs=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0),
    ]
    alone = sample(params[:1], x[:1])
    x[1, 5] = INF
    x[2, 9] = float("nan")
    procs, md = batch(params)
    out = Sampler(procs, generator=torch.Generator().manual_seed(0))(x.clone(), md, pristine=x)
    assert out.sampled_token_ids[0] == alone.sampled_token_ids[0]
    assert torch.equal(out.logprobs.logprobs[0, :3], alone.logprobs.logprobs[0, :3])
    assert out.sampled_token_ids[1].item() == 5 and out.errors.tolist() == [False, False, True]
    assert "the model" in out.error_messages[2]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.sampled_from([0.5, -2.0, float("-inf"), float("inf"), float("nan")]), min_size=1, max_size=9),
        min_size=1,
        max_size=6,
    ).filter(lambda r: len({len(x) for x in r}) == 1)
)
def test_the_cpu_shortcut_is_taken_exactly_when_the_rewrite_is_the_identity(rows: list[list[float]]) -> None:
    """On the CPU, a batch with no NaN and no +inf skips the rewrite (``clean``); any other batch is
    rewritten, and the clean verdict never changes a value."""
    from worker.ops.non_finite import non_finite_rows, resolve_non_finite_

    x = torch.tensor(rows)
    nf = non_finite_rows(x)
    expect_clean = not any(v != v or v == float("inf") for row in rows for v in row)
    assert nf.clean == expect_clean
    assert nf.nan.tolist() == [any(v != v for v in row) for row in rows]
    y = x.clone()
    resolve_non_finite_(y, nf)
    if expect_clean:
        assert torch.equal(y, x)
    z = x.clone()  # the slow path's answer, forced: the same flags without the hint
    resolve_non_finite_(z, type(nf)(nf.nan, nf.shift, nf.cap, False))
    assert torch.equal(torch.nan_to_num(y, nan=7.0), torch.nan_to_num(z, nan=7.0))

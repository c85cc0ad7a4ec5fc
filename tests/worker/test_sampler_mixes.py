"""The bench's mixes a-d at small shapes: every row's token (and mix d's logprobs) pinned against the
plain per-row reference, given the same uniform.

The reference (``sampler_reference.draw_sequence`` / ``inverse_cdf``) walks the documented
candidates in the documented order with float64 sums; the sampler's block sums are float32, so a
row whose target lands within 1e-6 of the total from a boundary (or whose top-p cut is within
1e-5) is not checked, and the test asserts that such rows are rare.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker import sampler_reference as ref
from tests.worker.test_sampler import batch
from worker.batch import seeded_generator
from worker.bench.sampler import mix_params
from worker.sampler import Sampler

CPU = torch.device("cpu")
DRAW_NOISE = 1e-6  # float32 block sums move a boundary by ~1e-7 of the total
TOP_P_NOISE = 1e-5


def _uniforms(params: list, seed: int) -> list[float]:
    """Each random row's uniform, as ``ops.draw.uniforms`` gives it: unseeded rows share the
    sampler's generator in draw order (top-k rows, then top-p rows, then the rest), seeded rows
    take one value from their own generator."""
    v_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    topk = [i for i in v_rows if p_topk(params[i])]
    rest = [i for i in v_rows if not p_topk(params[i])]
    order = topk + [i for i in rest if params[i].top_p < 1.0] + [i for i in rest if params[i].top_p >= 1.0]
    shared = torch.rand(len(order), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).tolist()
    u = [float("nan")] * len(params)
    for pos, i in enumerate(order):
        s = params[i].seed
        u[i] = (
            shared[pos] if s is None else float(torch.rand(1, dtype=torch.float64, generator=seeded_generator(s, CPU)))
        )
    return u


def p_topk(p) -> bool:
    return p.top_k > 0  # every mix keeps top_k below the vocabulary


@pytest.mark.parametrize(
    ("b", "v", "mix", "scale"),
    [
        *[(32, 3000, m, 1.0) for m in "abcd"],
        *[(32, 3000, m, 8.0) for m in "cd"],  # peaked rows: top-p settled by the probe
        (8, 60000, "c", 1.0),  # top-k through block maxima
    ],
)
def test_mix_tokens_match_the_reference(b: int, v: int, mix: str, scale: float) -> None:
    rows = mix_params(mix, b, v, seed=3)
    params = [p for p, _, _ in rows]
    prompts = [pr for _, pr, _ in rows]
    outputs = [o for _, _, o in rows]
    x = torch.randn(b, v, generator=torch.Generator().manual_seed(5)) * scale
    procs, md = batch(params, prompts=prompts, outputs=outputs)
    out = Sampler(procs, generator=torch.Generator().manual_seed(9))(x.clone(), md)
    assert not out.errors.any()
    u = _uniforms(params, 9)
    checked = 0
    for r, p in enumerate(params):
        got = out.sampled_token_ids[r].item()
        if p.is_greedy:
            assert got == ref.greedy_token(ref.before_temperature(x[r], p, prompts[r], outputs[r])), r
            checked += 1
            continue
        if p.top_p < 1.0 and p.top_k == 0:
            pre = ref.min_p(
                ref.before_temperature(x[r], p, prompts[r], outputs[r]) / torch.tensor(p.temperature), p.min_p
            )
            if ref.top_p_margin(pre, float(torch.tensor(p.top_p))) < TOP_P_NOISE:
                continue
        want, margin = ref.inverse_cdf(*ref.draw_sequence(x[r], p, prompts[r], outputs[r]), u[r])
        if margin < DRAW_NOISE:
            continue
        assert got == want, (r, p)
        checked += 1
    assert checked >= b - max(1, b // 10)

    if mix == "d":  # logprobs=5, raw: the model's logprobs, top-5 by value then id, rank counts >=
        lp = out.logprobs
        assert lp is not None
        for r in range(b):
            raw = torch.log_softmax(x[r], -1)
            top = ref.order(raw)[:5]
            tok = out.sampled_token_ids[r].item()
            assert lp.token_ids[r].tolist() == [tok, *top]
            assert torch.equal(lp.logprobs[r], torch.cat([raw[tok : tok + 1], raw[top]]))
            assert lp.ranks[r].item() == int((raw >= raw[tok]).sum())

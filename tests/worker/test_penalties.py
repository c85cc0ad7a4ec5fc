"""Penalties: bit-identical to the per-row formulas, touching only the tokens a row has seen."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker import sampler_reference as ref
from tests.worker.sampler_reference import logit_rows
from worker.logits_processor.interface import BatchUpdate, MoveDirectionality
from worker.logits_processor.penalties import PenaltiesLogitsProcessor
from worker.sampling_params import SamplingParams

V = 40
CPU = torch.device("cpu")


def _params(rng: random.Random) -> SamplingParams:
    pick = rng.random()
    return SamplingParams(
        repetition_penalty=rng.choice([1.0, 0.5, 1.3, 2.0]) if pick < 0.8 else 1.0,
        frequency_penalty=rng.choice([0.0, -1.5, 0.2, 2.0]),
        presence_penalty=rng.choice([0.0, 0.2, -2.0]),
    )


@settings(max_examples=60, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6))
def test_matches_reference_and_touches_only_seen_tokens(data: st.DataObject, seed: int, n: int) -> None:
    rng = random.Random(seed)
    params = [_params(rng) for _ in range(n)]
    prompts = [[rng.randrange(V) for _ in range(rng.randint(0, 8))] for _ in range(n)]
    outputs = [[rng.randrange(V) for _ in range(rng.randint(0, 8))] for _ in range(n)]
    proc = PenaltiesLogitsProcessor(None, CPU, False)
    proc.update_state(BatchUpdate(n, [], [], [(i, params[i], prompts[i], outputs[i]) for i in range(n)]))
    for _ in range(2):
        x = data.draw(logit_rows(n, V))
        got = proc.apply(x.clone())
        for r in range(n):
            p = params[r]
            if not p.uses_penalties:
                assert torch.equal(got[r], x[r])
                continue
            want = ref.penalties(
                x[r], prompts[r], outputs[r], p.repetition_penalty, p.frequency_penalty, p.presence_penalty
            )
            assert torch.equal(got[r], want)
            unseen = sorted(set(range(V)) - set(prompts[r]) - set(outputs[r]))
            assert torch.equal(got[r, unseen], x[r, unseen])
        for out in outputs:
            out.append(rng.randrange(V))
        proc.update_state(None)


def test_frequency_and_presence_use_output_tokens_only() -> None:
    proc = PenaltiesLogitsProcessor(None, CPU, False)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    proc.update_state(BatchUpdate(1, [], [], [(0, p, [4, 4, 6], [6, 6, 9])]))
    x = proc.apply(torch.zeros(1, V))
    assert x[0, 4].item() == 0.0  # prompt only
    assert x[0, 6].item() == -1.25  # 2 * 0.5 + 0.25
    assert x[0, 9].item() == -0.75
    assert proc.has_active_rows and not proc.is_argmax_invariant()


def test_repetition_over_prompt_and_output_by_sign() -> None:
    proc = PenaltiesLogitsProcessor(None, CPU, False)
    p = SamplingParams(repetition_penalty=2.0)
    proc.update_state(BatchUpdate(1, [], [], [(0, p, [1, 2], [2, 3])]))
    x = torch.zeros(1, V)
    x[0, 1], x[0, 2], x[0, 3], x[0, 5] = 4.0, -4.0, 1.0, 4.0
    got = proc.apply(x)
    assert got[0, :6].tolist() == [0.0, 2.0, -8.0, 0.5, 0.0, 4.0]


def test_rows_follow_a_swap() -> None:
    proc = PenaltiesLogitsProcessor(None, CPU, False)
    proc.update_state(
        BatchUpdate(2, [], [], [(0, SamplingParams(presence_penalty=1.0), None, [7]), (1, SamplingParams(), None, [8])])
    )
    proc.update_state(BatchUpdate(2, [], [(0, 1, MoveDirectionality.SWAP)], []))
    x = proc.apply(torch.zeros(2, V))
    assert x[1, 7].item() == -1.0 and x.abs().sum().item() == 1.0

"""Built-in processors against the per-row reference, and their programming-model contracts."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker import sampler_reference as ref
from tests.worker.sampler_reference import logit_rows
from worker.logits_processor.builtin import (
    AllowedTokenIdsLogitsProcessor,
    BadWordsLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from worker.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality
from worker.logits_processor.penalties import PenaltiesLogitsProcessor
from worker.sampling_params import SamplingParams
from worker.testing import CharTokenizer, random_params

V = 48
CPU = torch.device("cpu")
Reference = Callable[[torch.Tensor, SamplingParams, list[int]], torch.Tensor]

REFERENCES: dict[type[LogitsProcessor], Reference] = {
    AllowedTokenIdsLogitsProcessor: lambda x, p, out: ref.allowed(x, p.allowed_token_ids),
    BadWordsLogitsProcessor: lambda x, p, out: ref.bad_words(x, p.bad_words_token_ids, out),
    MinTokensLogitsProcessor: lambda x, p, out: ref.min_tokens(x, p.min_tokens, sorted(p.all_stop_token_ids), out),
    LogitBiasLogitsProcessor: lambda x, p, out: ref.logit_bias(x, p.logit_bias),
    MinPLogitsProcessor: lambda x, p, out: x.clone() if p.is_greedy else ref.min_p(x, p.min_p),
}


def _add_all(proc: LogitsProcessor, params: list[SamplingParams], outputs: list[list[int]]) -> None:
    added = [(i, p, [1, 2, 3], out) for i, (p, out) in enumerate(zip(params, outputs))]
    proc.update_state(BatchUpdate(batch_size=len(params), removed=[], moved=[], added=added))


@pytest.mark.parametrize("cls", list(REFERENCES))
@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6))
def test_processor_matches_reference_as_outputs_grow(cls: type, data: st.DataObject, seed: int, n: int) -> None:
    rng = random.Random(seed)
    params = [random_params(rng, V) for _ in range(n)]
    outputs = [[rng.randrange(V) for _ in range(rng.randint(0, 5))] for _ in range(n)]
    proc = cls(None, CPU, False)
    _add_all(proc, params, outputs)
    for step in range(3):
        x = data.draw(logit_rows(n, V))
        got = proc.apply(x.clone())
        for r in range(n):
            assert torch.equal(got[r], REFERENCES[cls](x[r], params[r], outputs[r])), (step, r, params[r])
        for out in outputs:  # the engine appends a token; processors read the live lists
            out.append(rng.randrange(V))
        proc.update_state(None)


@pytest.mark.parametrize("cls", [*REFERENCES, PenaltiesLogitsProcessor])
def test_no_active_row_returns_input_untouched(cls: type) -> None:
    proc = cls(None, CPU, False)
    _add_all(proc, [SamplingParams(), SamplingParams(temperature=0.0, min_p=0.5)], [[], []])
    x = torch.randn(2, V)
    before = x.clone()
    assert proc.apply(x) is x
    assert torch.equal(x, before)
    assert not proc.has_active_rows


def test_argmax_invariance_flags() -> None:
    assert MinPLogitsProcessor(None, CPU, False).is_argmax_invariant()
    for cls in (
        AllowedTokenIdsLogitsProcessor,
        BadWordsLogitsProcessor,
        MinTokensLogitsProcessor,
        LogitBiasLogitsProcessor,
    ):
        assert not cls(None, CPU, False).is_argmax_invariant()
    assert not PenaltiesLogitsProcessor(None, CPU, False).is_argmax_invariant()


def test_min_tokens_stops_masked_until_position_min_tokens() -> None:
    p = SamplingParams(min_tokens=2, stop_token_ids=[5])
    p.update_from_tokenizer(CharTokenizer(V), eos_token_ids={V - 1})
    out: list[int] = []
    proc = MinTokensLogitsProcessor(None, CPU, False)
    _add_all(proc, [p], [out])
    masked = []
    for _ in range(4):
        x = proc.apply(torch.zeros(1, V))
        masked.append(bool(torch.isinf(x[0, 5])) and bool(torch.isinf(x[0, V - 1])))
        out.append(0)
        proc.update_state(None)
    assert masked == [True, True, False, False]  # a stop token may be the 3rd token (position 2)


def test_bad_words_ban_the_last_token_after_the_prefix_only() -> None:
    p = SamplingParams(bad_words=["ab", "c"])
    tok = CharTokenizer(V)
    p.update_from_tokenizer(tok)
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    space_a = tok.encode(" a")
    out = [a]
    proc = BadWordsLogitsProcessor(None, CPU, False)
    _add_all(proc, [p], [out])
    x = proc.apply(torch.zeros(1, V))
    assert torch.isinf(x[0, b]) and torch.isinf(x[0, tok.encode("c")[0]])
    out.append(b)
    proc.update_state(None)
    x = proc.apply(torch.zeros(1, V))
    assert not torch.isinf(x[0, b])  # prefix no longer at the end
    out.extend(space_a)  # the leading-space form " ab" is banned too
    x = proc.apply(torch.zeros(1, V))
    assert torch.isinf(x[0, tok.encode(" ab")[-1]])


def test_state_follows_moves_and_swaps() -> None:
    proc = LogitBiasLogitsProcessor(None, CPU, False)
    pa, pb = SamplingParams(logit_bias={1: 5.0}), SamplingParams(logit_bias={2: -5.0})
    proc.update_state(BatchUpdate(3, [], [], [(0, pa, None, []), (2, pb, None, [])]))
    proc.update_state(
        BatchUpdate(2, [1], [(2, 1, MoveDirectionality.UNIDIRECTIONAL), (0, 1, MoveDirectionality.SWAP)], [])
    )
    x = proc.apply(torch.zeros(2, V))
    assert x[0, 2].item() == -5.0 and x[1, 1].item() == 5.0
    assert x.abs().sum().item() == 10.0


def test_min_p_keeps_ties_with_the_max_and_skips_greedy_rows() -> None:
    proc = MinPLogitsProcessor(None, CPU, False)
    params = [SamplingParams(min_p=1.0), SamplingParams(temperature=0.0, min_p=0.9), SamplingParams(min_p=0.5)]
    _add_all(proc, params, [[], [], []])
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, 3.0, 3.0, 2.0], [0.0, 0.0, -0.6931, -0.7]]).repeat_interleave(12, 1)[
        :, :V
    ]
    got = proc.apply(x.clone())
    assert torch.equal(torch.isfinite(got[0]), x[0] == 3.0)
    assert torch.equal(got[1], x[1])
    # prob ratio e^-0.6931 > 0.5 survives, e^-0.7 < 0.5 does not
    assert torch.equal(torch.isfinite(got[2]), x[2] > -0.7)


def test_allowed_ids_rows_outside_the_list_untouched() -> None:
    proc = AllowedTokenIdsLogitsProcessor(None, CPU, False)
    _add_all(proc, [SamplingParams(), SamplingParams(allowed_token_ids=[3, 3, 7])], [[], []])
    x = torch.randn(2, V)
    got = proc.apply(x.clone())
    assert torch.equal(got[0], x[0])
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [3, 7]
    assert torch.equal(got[1, [3, 7]], x[1, [3, 7]])

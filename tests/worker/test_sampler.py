"""The batched Sampler against the per-row reference: steps, distributions, invariance, errors."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.worker import sampler_reference as ref
from tests.worker.sampler_reference import logit_rows
from worker.batch import PersistentBatch
from worker.logits_processor.builtin import MinPLogitsProcessor
from worker.logits_processor.errors import ProcessorError
from worker.logits_processor.interface import BatchUpdate, LogitsProcessor
from worker.logits_processor.penalties import PenaltiesLogitsProcessor
from worker.logits_processor.registry import LogitsProcessors, build_logits_processors
from worker.sampler import Sampler, SamplerOutput
from worker.sampling_metadata import SamplingMetadata
from worker.sampling_params import SamplingParams
from worker.testing import CharTokenizer, random_params

CPU = torch.device("cpu")
P_MIN = 1e-3


def batch(
    params: Sequence[SamplingParams],
    prompts: Sequence[list[int]] | None = None,
    outputs: Sequence[list[int]] | None = None,
    processors: LogitsProcessors | None = None,
    custom: Sequence[Any] = (),
) -> tuple[LogitsProcessors, SamplingMetadata]:
    """Real processors and a real PersistentBatch holding ``params`` in rows 0..n-1."""
    procs = processors or build_logits_processors(None, CPU, False, custom=custom, entry_points=False)
    pb = PersistentBatch(len(params))
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]
    procs.update_state(pb.update([], [(str(i), p, prompts[i], outputs[i]) for i, p in enumerate(params)]))
    return procs, pb.sampling_metadata()


def sample(params: Sequence[SamplingParams], x: torch.Tensor, seed: int = 0, **kw: Any) -> SamplerOutput:
    procs, md = batch(params, **kw)
    return Sampler(procs, generator=torch.Generator().manual_seed(seed))(x.clone(), md)


def _random_params(rng: random.Random, v: int, **overrides: Any) -> SamplingParams:
    """random_params with some fields set (a validated copy), completed as the engine would."""
    p = dataclasses.replace(random_params(rng, v), **overrides)
    p.update_from_tokenizer(CharTokenizer(v), eos_token_ids={v - 1})
    return p


# -- step 7: greedy ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6))
def test_greedy_is_the_argmax_after_penalties_lowest_id(data: st.DataObject, seed: int, n: int) -> None:
    v = 40
    rng = random.Random(seed)
    params = [_random_params(rng, v, temperature=0.0) for _ in range(n)]
    prompts = [[rng.randrange(v) for _ in range(3)] for _ in range(n)]
    outputs = [[rng.randrange(v) for _ in range(rng.randint(0, 4))] for _ in range(n)]
    x = data.draw(logit_rows(n, v))
    out = sample(params, x, prompts=prompts, outputs=outputs)
    for r in range(n):
        row = ref.before_temperature(x[r], params[r], prompts[r], outputs[r])
        if torch.isfinite(row).any():
            assert not out.errors[r]
            assert out.sampled_token_ids[r].item() == ref.greedy_token(row)
        else:
            assert out.errors[r] and out.sampled_token_ids[r].item() == -1


@settings(max_examples=30, deadline=None)
@given(data=st.data(), v=st.sampled_from([16, 300, 3000]))
def test_top_k_one_equals_greedy(data: st.DataObject, v: int) -> None:
    x = data.draw(logit_rows(4, v))
    greedy = sample([SamplingParams(temperature=0.0)] * 4, x)
    top1 = sample([SamplingParams(temperature=t, top_k=1) for t in (1.0, 0.5, 1.0, 2.0)], x)
    assert torch.equal(greedy.sampled_token_ids, top1.sampled_token_ids)


# -- steps 3-7c: processed logits -------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**31 - 1), n=st.integers(1, 5))
def test_processed_logits_match_reference(data: st.DataObject, seed: int, n: int) -> None:
    v = 16
    rng = random.Random(seed)
    params = [_random_params(rng, v, logprobs=v, logprobs_mode="processed_logits") for _ in range(n)]
    prompts = [[rng.randrange(v) for _ in range(3)] for _ in range(n)]
    outputs = [[rng.randrange(v) for _ in range(rng.randint(0, 4))] for _ in range(n)]
    x = data.draw(logit_rows(n, v))
    want = []
    for r, p in enumerate(params):
        top_p = float(torch.tensor(p.top_p, dtype=torch.float32))
        row = ref.processed(x[r], p, prompts[r], outputs[r])
        if not p.is_greedy and top_p < 1.0 and torch.isfinite(row).any():
            pre = ref.top_k(
                ref.min_p(
                    ref.before_temperature(x[r], p, prompts[r], outputs[r]) / torch.tensor(p.temperature), p.min_p
                ),
                p.top_k,
            )
            assume(ref.top_p_margin(pre, top_p) > 1e-5)
        want.append(row)
    out = sample(params, x, prompts=prompts, outputs=outputs)
    assert out.logprobs is not None
    for r in range(n):
        if out.errors[r]:
            assert not torch.isfinite(want[r]).any()
            continue
        got = torch.full((v,), float("nan"))
        got[out.logprobs.token_ids[r, 1:]] = out.logprobs.logprobs[r, 1:]
        assert torch.equal(got, want[r]), (r, params[r])


# -- step 7d: the draw matches softmax of the processed logits -----------------------------------

DIST_CASES = [
    (SamplingParams(temperature=1.0), "normal", 24),
    (SamplingParams(temperature=0.6, top_k=5), "normal", 24),
    (SamplingParams(temperature=1.0, top_p=0.6), "normal", 24),
    (SamplingParams(temperature=1.3, min_p=0.2), "normal", 24),
    (SamplingParams(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05), "normal", 24),
    (SamplingParams(temperature=1.0, top_k=3), "ties", 24),  # exactly 3 of the tied tokens: the lowest ids
    (SamplingParams(temperature=1.0, top_p=0.5), "ties", 24),
    (SamplingParams(temperature=1.0, top_p=0.9), "normal", 3000),  # histogram path
    (SamplingParams(temperature=1.0, top_p=0.9), "peaked", 3000),  # probe path
    (SamplingParams(temperature=1.0, top_k=40, top_p=0.95), "normal", 3000),  # block top-k path
]


def _designed_row(kind: str, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(v)
    if kind == "ties":
        x = torch.zeros(v)
        x[v // 2] = 1.0
        x[v - 3 :] = -1.0
        return x
    x = torch.randn(v, generator=g)
    return x * 8 if kind == "peaked" else x


@pytest.mark.parametrize(("params", "kind", "v"), DIST_CASES)
def test_draws_follow_softmax_of_processed_logits(params: SamplingParams, kind: str, v: int) -> None:
    row = _designed_row(kind, v)
    n = 4000 if v < 1000 else 1000
    tokens = torch.cat(
        [sample([params] * n, row.expand(n, v), seed=s).sampled_token_ids for s in range(1 if v < 1000 else 3)]
    )
    assert ref.chi2_pvalue(tokens, ref.distribution(row, params)) > P_MIN


# -- batch invariance ----------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 7), v=st.sampled_from([40, 3000]))
def test_seeded_and_greedy_rows_are_batch_invariant(seed: int, n: int, v: int) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    targets = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=rng.choice([0, 5]), min_p=0.05, seed=11, logprobs=3),
        SamplingParams(temperature=1.1, top_p=0.7, seed=12, logprobs=2, logprobs_mode="processed_logprobs"),
        SamplingParams(temperature=0.0, logprobs=4, repetition_penalty=1.3),
    ]
    rows = torch.randn(len(targets), v, generator=g) * rng.choice([1.0, 8.0])
    alone = [sample([p], rows[i : i + 1], prompts=[[1, 2]], outputs=[[3]]) for i, p in enumerate(targets)]
    for i, p in enumerate(targets):
        others = [_random_params(rng, v) for _ in range(n)]
        pos = rng.randrange(n + 1)
        params = [*others[:pos], p, *others[pos:]]
        x = torch.randn(n + 1, v, generator=g)
        x[pos] = rows[i]
        prompts = [[rng.randrange(v)] for _ in params]
        outputs = [[rng.randrange(v)] for _ in params]
        prompts[pos], outputs[pos] = [1, 2], [3]
        out = sample(params, x, seed=seed, prompts=prompts, outputs=outputs)
        assert out.sampled_token_ids[pos].item() == alone[i].sampled_token_ids[0].item()
        assert out.logprobs is not None and alone[i].logprobs is not None
        k = p.logprobs or 0
        assert torch.equal(out.logprobs.token_ids[pos, : k + 1], alone[i].logprobs.token_ids[0, : k + 1])
        assert torch.equal(out.logprobs.logprobs[pos, : k + 1], alone[i].logprobs.logprobs[0, : k + 1])
        assert out.logprobs.ranks[pos].item() == alone[i].logprobs.ranks[0].item()


# -- step 7b: argmax-invariant processors --------------------------------------------------------


class CountingMinP(MinPLogitsProcessor):
    """A real Min-P that counts its apply calls."""

    calls = 0

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().apply(logits)


class HalveEverything(LogitsProcessor):
    """Argmax-invariant but not harmless: halves every logit of every row (changes logprobs)."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.mul_(0.5)

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass


def test_argmax_invariant_processors_skipped_when_all_greedy() -> None:
    CountingMinP.calls = 0
    x = torch.randn(3, 50)
    greedy = [SamplingParams(temperature=0.0, min_p=0.5)] * 3
    sample(greedy, x, custom=[CountingMinP])
    assert CountingMinP.calls == 0
    sample([*greedy[:2], SamplingParams(min_p=0.5)], x, custom=[CountingMinP])
    assert CountingMinP.calls == 1


def test_argmax_invariant_processors_leave_greedy_rows_alone_in_a_mixed_batch() -> None:
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    g = SamplingParams(temperature=0.0, logprobs=5, logprobs_mode="processed_logprobs")
    all_greedy = sample([g, g, g], x, custom=[HalveEverything])
    mixed = sample([g, SamplingParams(temperature=1.0), g], x, custom=[HalveEverything])
    assert all_greedy.logprobs is not None and mixed.logprobs is not None
    for r in (0, 2):
        assert mixed.sampled_token_ids[r] == all_greedy.sampled_token_ids[r]
        assert torch.equal(mixed.logprobs.logprobs[r], all_greedy.logprobs.logprobs[r])
        assert torch.equal(mixed.logprobs.token_ids[r], all_greedy.logprobs.token_ids[r])


def test_all_greedy_batch_consumes_no_seeded_randomness() -> None:
    procs, md = batch([SamplingParams(temperature=0.0, seed=5)])
    before = md.generators[0].get_state().clone()
    Sampler(procs)(torch.randn(1, 30), md)
    assert torch.equal(md.generators[0].get_state(), before)


# -- errors ----------------------------------------------------------------------------------------


def test_no_finite_logit_flags_only_that_row() -> None:
    v = 300
    tok = CharTokenizer(v)
    banned = tok.encode("a")[0]
    doomed = SamplingParams(allowed_token_ids=[banned], bad_words=["a"])
    doomed.update_from_tokenizer(tok)
    doomed_greedy = SamplingParams(temperature=0.0, allowed_token_ids=[banned], bad_words=["a"])
    doomed_greedy.update_from_tokenizer(tok)
    fine = [SamplingParams(), SamplingParams(top_k=3), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)]
    params = [
        fine[0],
        doomed,
        fine[1],
        doomed_greedy,
        fine[2],
        fine[3],
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.5),
    ]
    x = torch.randn(len(params), v)
    x[6] = float("-inf")  # top-k row with nothing finite
    x[7, 5] = float("nan")  # a NaN logit poisons the row
    out = sample(params, x)
    assert out.errors.tolist() == [False, True, False, True, False, False, True, True]
    assert (out.sampled_token_ids[out.errors] == -1).all()
    assert ((out.sampled_token_ids[~out.errors] >= 0) & (out.sampled_token_ids[~out.errors] < v)).all()
    assert out.sampled_token_ids[4].item() == ref.greedy_token(x[4])


def test_processor_exception_is_wrapped() -> None:
    class Boom(HalveEverything):
        def is_argmax_invariant(self) -> bool:
            return False

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    with pytest.raises(ProcessorError) as info:
        sample([SamplingParams()], torch.randn(1, 10), custom=[Boom])
    assert info.value.processor == "Boom" and info.value.phase == "apply"
    assert isinstance(info.value.cause, RuntimeError)


def test_penalties_skipped_when_no_row_uses_them() -> None:
    class CountingPenalties(PenaltiesLogitsProcessor):
        calls = 0

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            type(self).calls += 1
            return super().apply(logits)

    base = build_logits_processors(None, CPU, False, entry_points=False)
    procs = LogitsProcessors(base.all, CountingPenalties(None, CPU, False))
    sample([SamplingParams(), SamplingParams(temperature=0.0)], torch.randn(2, 20), processors=procs)
    assert CountingPenalties.calls == 0
    procs = LogitsProcessors(base.all, CountingPenalties(None, CPU, False))
    sample([SamplingParams(), SamplingParams(presence_penalty=0.5)], torch.randn(2, 20), processors=procs)
    assert CountingPenalties.calls == 1


# -- step 8: logprobs ------------------------------------------------------------------------------


def test_logprobs_modes_topk_and_rank() -> None:
    v = 12
    x = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    modes = ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
    params = [SamplingParams(temperature=0.5, top_k=2, logprobs=3, logprobs_mode=m, seed=1) for m in modes]
    params.append(SamplingParams(temperature=0.0, logprobs=0))
    params.append(SamplingParams(temperature=0.0))
    out = sample(params, x.expand(len(params), v))
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (6, 4)
    raw_lp = torch.log_softmax(x[0], -1)
    # top-3 among three tied 2.0s and a 1.0: value desc, ties by lower id
    assert lp.token_ids[0, 1:].tolist() == [1, 2, 4]
    assert torch.equal(lp.logprobs[0, 1:], raw_lp[[1, 2, 4]])
    assert torch.equal(lp.logprobs[1, 1:], x[0, [1, 2, 4]])
    # processed: temperature 0.5 then top-2 keeps ids 1 and 2; the third place is -inf (lowest id: 0)
    proc = torch.full((v,), float("-inf"))
    proc[[1, 2]] = 4.0
    assert lp.token_ids[3, 1:].tolist() == [1, 2, 0]
    assert torch.equal(lp.logprobs[3, 1:], proc[[1, 2, 0]])
    assert torch.equal(lp.logprobs[2, 1:], torch.log_softmax(proc, -1)[[1, 2, 0]])
    for r in range(4):
        s = out.sampled_token_ids[r].item()
        assert s in (1, 2) and lp.token_ids[r, 0].item() == s
        assert lp.ranks[r].item() == (3 if r < 2 else 2)  # rank counts >=: three raw ties, two kept
    # greedy: token 1 (lowest id of the max), its raw logprob, rank = number of logprobs >= it = 3
    assert out.sampled_token_ids[4].item() == 1
    assert lp.logprobs[4, 0].item() == raw_lp[1].item() and lp.ranks[4].item() == 3
    assert lp.ranks[5].item() == -1 and lp.token_ids[5, 0].item() == 1 and lp.token_ids[5, 1:].tolist() == [-1] * 3


# -- the benchmark runs ---------------------------------------------------------------------------


def test_bench_main_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    from worker.bench.sampler import main, mix_params

    argv = ["--batch-sizes", "4", "--vocab-sizes", "300", "--repeats", "2", "--warmup", "1", "--no-peaked"]
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 | 300 |")]
    assert len(rows) == 8  # four mixes, streamed and then in the final table
    c = [p for p, _, _ in mix_params("c", 64, 300, 0)]
    assert c[0].is_greedy and c[1].temperature == 0.9 and all(p.seed is not None for p in c)
    assert all(p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0 for p in c if p.is_greedy)

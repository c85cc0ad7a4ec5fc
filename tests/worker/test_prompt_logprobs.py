"""prompt_logprobs against a plain transformers forward over the whole prompt (the tiny model).

The reference is per prompt, obviously correct: log_softmax of ``model(prompt).logits``, row j-1
scoring prompt token j. The engine computes the same values inside its prefill forward, so they
must agree under chunked prefill, a warm prefix cache, preemption and n > 1 — and arrive once, in
the request's first output.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.worker.model_fixtures import suite_engine_kwargs
from tests.worker.test_engine import prompts_of
from tests.worker.test_paged_engine import _engine
from tests.worker.test_paged_engine import _run as run_paged
from worker.engine import LLMEngine
from worker.llm import LLM
from worker.model.runner import ScheduledSeq
from worker.outputs import PositionLogprobs, RequestOutput
from worker.sampling_params import SamplingParams

ATOL = 1e-4


def _run(
    engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], stagger: int = 0
) -> dict[str, RequestOutput]:
    """Step every request to its end; each first delta must carry its prompt logprobs (if asked)."""
    asked = {f"r{i}": p.prompt_logprobs is not None for i, (_, p) in enumerate(requests)}

    def check(delta: RequestOutput, first: bool) -> None:
        if first:
            assert (delta.prompt_logprobs is not None) == asked[delta.request_id], delta.request_id
        else:
            assert delta.prompt_logprobs is None, "prompt logprobs are sent once"

    return run_paged(engine, requests, stagger, check)


def _reference_rows(loaded, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([prompt], device=loaded.device)).logits[0]
    return torch.log_softmax(logits.float(), -1).cpu()


def assert_matches_reference(loaded, prompt: list[int], got: list[PositionLogprobs | None] | None, k: int) -> None:
    """Each position: the prompt token's logprob and true rank, plus exactly the top-k, as the reference."""
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    ref = _reference_rows(loaded, prompt)
    backend = loaded.tokenizer.backend_tokenizer
    for j in range(1, len(prompt)):
        row, tok, pos = ref[j - 1], prompt[j], got[j]
        assert pos is not None and tok in pos, f"position {j}"
        assert abs(pos[tok].logprob - float(row[tok])) < ATOL, f"position {j}"
        # The true rank, allowing only for reference values within the tolerance (near ties).
        lo = int((row > row[tok] + ATOL).sum()) + 1
        hi = int((row >= row[tok] - ATOL).sum())
        assert lo <= pos[tok].rank <= hi, f"position {j}: rank {pos[tok].rank} not in [{lo}, {hi}]"
        kth = float(row.topk(k).values[-1]) if k else float("inf")
        others = {t: lp for t, lp in pos.items() if t != tok}
        assert sorted(lp.rank for lp in others.values()) == sorted(set(lp.rank for lp in others.values()))
        for t, lp in pos.items():
            assert abs(lp.logprob - float(row[t])) < ATOL, f"position {j}: token {t}"
            assert lp.decoded_token == backend.decode([t], skip_special_tokens=False)
        for t, lp in others.items():
            assert 1 <= lp.rank <= k and lp.logprob >= kth - ATOL, f"position {j}: {t} is not in the top {k}"
        assert len(pos) in (k, k + 1), f"position {j}: {len(pos)} entries for k={k}"


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    budget=st.sampled_from([8, 13, 64]),
    ks=st.lists(st.sampled_from([None, 0, 1, 3]), min_size=1, max_size=4),
)
def test_prompt_logprobs_match_reference_under_chunked_prefill(tiny_model, seed: int, budget: int, ks) -> None:
    prompts = prompts_of(tiny_model, len(ks), lo=1, hi=40, seed=seed)
    reqs = [
        (p, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=k))
        for p, k in zip(prompts, ks)
    ]
    done = _run(_engine(tiny_model, max_num_batched_tokens=budget), reqs)
    for i, (prompt, k) in enumerate(zip(prompts, ks)):
        out = done[f"r{i}"]
        if k is None:
            assert out.prompt_logprobs is None
        else:
            assert_matches_reference(tiny_model, prompt, out.prompt_logprobs, k)


def test_warm_prefix_cache_still_gives_every_position(tiny_model) -> None:
    prompt = prompts_of(tiny_model, 1, lo=40, hi=41, seed=7)[0]
    engine = _engine(tiny_model, enable_prefix_caching=True)
    _run(engine, [(prompt, SamplingParams(max_tokens=1))])
    hits_before = engine.kv_stats()["prefix_hit_tokens"]
    done = _run(engine, [(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))])
    assert engine.kv_stats()["prefix_hit_tokens"] == hits_before, "a prompt-logprobs request reuses no cached block"
    assert_matches_reference(tiny_model, prompt, done["r0"].prompt_logprobs, 2)
    again = _run(engine, [(prompt, SamplingParams(max_tokens=1))])  # the cache still serves others
    assert engine.kv_stats()["prefix_hit_tokens"] > hits_before and again["r0"].prompt_logprobs is None


def test_preemption_recomputes_without_duplicates(tiny_model) -> None:
    prompts = prompts_of(tiny_model, 6, lo=20, hi=50, seed=11)
    reqs = [
        (p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1 if i % 2 else None))
        for i, p in enumerate(prompts)
    ]
    engine = _engine(tiny_model, blocks=14, block_size=8, max_num_batched_tokens=24)
    done = _run(engine, reqs, stagger=1)
    assert engine.kv_stats()["num_preemptions"] > 0, "the pool must be tight enough to preempt"
    for i, p in enumerate(prompts):
        if i % 2:
            assert_matches_reference(tiny_model, p, done[f"r{i}"].prompt_logprobs, 1)
        else:
            assert done[f"r{i}"].prompt_logprobs is None


def test_n_children_share_one_computation(tiny_model) -> None:
    prompt = prompts_of(tiny_model, 1, lo=30, hi=31, seed=3)[0]
    engine = _engine(tiny_model, max_num_batched_tokens=16, enable_prefix_caching=True)
    done = _run(engine, [(prompt, SamplingParams(n=3, seed=5, max_tokens=3, prompt_logprobs=2))])
    out = done["r0"]
    assert len(out.outputs) == 3
    assert_matches_reference(tiny_model, prompt, out.prompt_logprobs, 2)


def test_one_token_prompt_has_only_the_leading_none(tiny_model) -> None:
    done = _run(_engine(tiny_model), [([42], SamplingParams(max_tokens=1, prompt_logprobs=3))])
    assert done["r0"].prompt_logprobs == [None]


def test_offline_llm_returns_prompt_logprobs(tiny_model) -> None:
    llm = LLM(loaded=tiny_model, load_entry_points=False, **suite_engine_kwargs())
    prompt = prompts_of(tiny_model, 1, lo=12, hi=13, seed=9)[0]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert_matches_reference(tiny_model, prompt, out.prompt_logprobs, 0)


@pytest.mark.parametrize("value", [-2, -100, 1.5, True, "3"])
def test_bad_prompt_logprobs_name_the_field(value) -> None:
    with pytest.raises(ValueError, match=r"^prompt_logprobs: "):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_capped_by_max_logprobs() -> None:
    SamplingParams(prompt_logprobs=20).validate_for_model(1000, max_logprobs=20)
    with pytest.raises(ValueError, match=r"^prompt_logprobs: .*<= 20"):
        SamplingParams(prompt_logprobs=21).validate_for_model(1000, max_logprobs=20)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_minus_one_is_the_whole_vocabulary_where_max_logprobs_allows(field: str) -> None:
    """vLLM's -1: every token; allowed when max_logprobs is -1 (no cap) or at least the vocabulary."""
    params = SamplingParams(**{field: -1})
    for cap in (-1, 1000, 5000):
        params.validate_for_model(1000, max_logprobs=cap)
    with pytest.raises(ValueError, match=rf"^{field}: must be <= 999 .*whole vocabulary, 1000"):
        params.validate_for_model(1000, max_logprobs=999)
    resolved = params.resolved(1000)
    assert getattr(resolved, field) == 1000 and getattr(params, field) == -1
    assert SamplingParams(logprobs=3).resolved(1000) == SamplingParams(logprobs=3)


def test_minus_one_logprobs_return_every_token_of_the_vocabulary(tiny_model) -> None:
    llm = LLM(loaded=tiny_model, load_entry_points=False, **{**suite_engine_kwargs(), "max_logprobs": -1})
    prompt = prompts_of(tiny_model, 1, lo=6, hi=7, seed=4)[0]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1, ignore_eos=True))
    v = tiny_model.vocab_size
    (c,) = out.outputs
    assert [len(position) for position in c.logprobs] == [v, v]
    assert all(sorted(lp.rank for lp in position.values()) == list(range(1, v + 1)) for position in c.logprobs)
    assert [None if p is None else len(p) for p in out.prompt_logprobs] == [None] + [v] * (len(prompt) - 1)
    capped = LLM(loaded=tiny_model, load_entry_points=False, **suite_engine_kwargs())
    with pytest.raises(ValueError, match=r"logprobs: .*whole vocabulary"):
        capped.generate([prompt], SamplingParams(logprobs=-1))


def test_runner_returns_prompt_rows_after_sampled_rows(tiny_model) -> None:
    """Two chunks of one prompt and a plain row: sampled rows first, then each seq's prompt rows."""
    from worker.model.runner import ModelRunner

    prompt, other = prompts_of(tiny_model, 2, lo=20, hi=21, seed=5)
    runner = ModelRunner(tiny_model, num_blocks=16, block_size=8)
    first = runner.execute([ScheduledSeq(list(range(3)), prompt[:12], 0, False, prompt_logits=12)])
    rest = runner.execute(
        [
            ScheduledSeq(list(range(3)), prompt[12:], 12, True, prompt_logits=7),
            ScheduledSeq(list(range(3, 6)), other, 0, True),
        ]
    )
    assert first.shape[0] == 12 and rest.shape[0] == 2 + 7
    with torch.inference_mode():
        full = tiny_model.model(torch.tensor([prompt], device=tiny_model.device)).logits[0].float()
        plain = tiny_model.model(torch.tensor([other], device=tiny_model.device)).logits[0, -1].float()
    torch.testing.assert_close(first.float(), full[:12], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rest[0].float(), full[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rest[1].float(), plain, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rest[2:].float(), full[12:19], atol=1e-4, rtol=1e-4)


def test_abort_mid_prefill_ends_without_prompt_logprobs(tiny_model) -> None:
    engine = _engine(tiny_model, max_num_batched_tokens=8)
    prompt = prompts_of(tiny_model, 1, lo=40, hi=41, seed=2)[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, prompt_logprobs=1))
    assert engine.step() == []  # the first chunk ran; nothing to say yet
    engine.abort_request("r")
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.prompt_logprobs is None
    assert not engine.has_unfinished()

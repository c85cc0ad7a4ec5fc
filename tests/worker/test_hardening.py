"""Issue 8 on the engine, offline (LLM / LLMEngine / AsyncEngine), real tiny model (vocab 3000):
a validated value never crashes a step, a fault stays with its request, numerics per
docs/sampling.md "The nine steps"."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from tests.fixtures.seed_processors import DummyLogitsProcessor, RaisingLogitsProcessor
from tests.worker.fault_processors import (
    ArmedUpdateStateProcessor,
    FlakyApplyProcessor,
    ForceTokensProcessor,
    NaNProcessor,
)
from tests.worker.model_fixtures import engine_config
from tests.worker.test_engine import make_llm, prompts_of
from worker import AsyncEngine, SamplingParams
from worker.async_engine import EngineDeadError
from worker.engine import LLMEngine
from worker.outputs import LOGPROB_FLOOR, OutputAccumulator

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


_SOLO: dict[str, list[int]] = {}
_SOLO_LLM: list = []


def solo(loaded, prompt: list[int], params: SamplingParams) -> list[int]:
    """The request run alone (greedy or seeded, so one engine serves every solo run; cached:
    the bystanders recur across tests)."""
    assert params.is_greedy or params.seed is not None
    key = repr((prompt, params))
    if key not in _SOLO:
        if not _SOLO_LLM:
            _SOLO_LLM.append(make_llm(loaded))
        _SOLO[key] = _SOLO_LLM[0].generate([prompt], params)[0].outputs[0].token_ids
    return _SOLO[key]


# -- a validated value never crashes a step ---------------------------------------------------------


def test_seed_range_is_served_end_to_end(tiny_model):
    """[-2^63, 2^64) all run; 2^64 - 1 and -1 seed the same stream (seed % 2^64); n > 1 wraps."""
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=80)[0]
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    top = llm.generate([prompt], SamplingParams(seed=2**64 - 1, **sp))[0].outputs[0]
    minus_one = llm.generate([prompt], SamplingParams(seed=-1, **sp))[0].outputs[0]
    assert top.finish_reason == "length" and top.token_ids == minus_one.token_ids
    low = llm.generate([prompt], SamplingParams(seed=-(2**63), **sp))[0].outputs[0]
    assert low.finish_reason == "length"
    many = llm.generate([prompt], SamplingParams(seed=2**64 - 1, n=3, **sp))[0].outputs
    assert [c.finish_reason for c in many] == ["length"] * 3
    for bad in (2**64, -(2**63) - 1, 18446744073709551616):
        with pytest.raises(ValueError, match=r"^seed"):
            SamplingParams(seed=bad)


def test_huge_top_k(tiny_model):
    with pytest.raises(ValueError, match=r"^top_k"):
        SamplingParams(top_k=9223372036854775808)
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=81)[0]
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True, seed=5)
    huge = llm.generate([prompt], SamplingParams(top_k=2**63 - 1, **sp))[0].outputs[0]
    off = llm.generate([prompt], SamplingParams(top_k=0, **sp))[0].outputs[0]
    assert huge.finish_reason == "length" and huge.token_ids == off.token_ids


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("stop", dict(stop=["a\ud800"])),
        ("bad_words", dict(bad_words=["\udc00"])),
        ("extra_args", dict(extra_args={"k": "\ud800"})),
        ("extra_args", dict(extra_args={"\ud800": 1})),
        ("extra_args", dict(extra_args={"k": [{"x": float("nan")}]})),
        ("logit_bias", dict(logit_bias={5: float("nan")})),
        ("logit_bias", dict(logit_bias={5: float("inf")})),
        ("temperature", dict(temperature=float("nan"))),
        ("top_p", dict(top_p=float("nan"))),
        ("min_p", dict(min_p=float("nan"))),
        ("presence_penalty", dict(presence_penalty=float("nan"))),
        ("frequency_penalty", dict(frequency_penalty=float("-inf"))),
        ("repetition_penalty", dict(repetition_penalty=float("inf"))),
        ("max_tokens", dict(max_tokens=2**63)),
        ("n", dict(n=2**63)),
        ("logprobs", dict(logprobs=2**63)),
        ("stop_token_ids", dict(stop_token_ids=[2**63])),
        ("allowed_token_ids", dict(allowed_token_ids=[2**64])),
        ("logit_bias", dict(logit_bias={2**63: 1.0})),
    ],
)
def test_bad_values_are_a_clear_error_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        SamplingParams(**kwargs)


def test_validation_runs_again_on_every_path(tiny_model):
    """SamplingParams is frozen; a field forced past that is still caught by the one validator
    (engine/ingress), and a copy made with dataclasses.replace is validated again."""
    llm = make_llm(tiny_model)
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.seed = 2**64  # type: ignore[misc]  # the assignment the frozen dataclass refuses
    with pytest.raises(ValueError, match=r"^seed"):
        dataclasses.replace(p, seed=2**64)
    object.__setattr__(p, "seed", 2**64)
    with pytest.raises(ValueError, match=r"^seed"):
        llm.engine.validate(p)
    with pytest.raises(ValueError, match=r"^request 0: prompt: must be valid Unicode"):
        llm.generate(["x\ud800"], SamplingParams())
    assert not llm.engine.has_unfinished()


def test_repetition_penalty_1e_300_gives_a_valid_answer(tiny_model):
    """float32 rounds 1e-300 to 0 (and -inf * 0 is NaN): clamped, seen positive logits overflow
    to +inf and force those tokens - a valid answer, never an error finish."""
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=82)[0]
    for extra in (dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(allowed_token_ids=[5, 6, prompt[0]])):
        out = llm.generate([prompt], SamplingParams(repetition_penalty=1e-300, max_tokens=6, ignore_eos=True, **extra))
        c = out[0].outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 6, c.error
    huge = llm.generate([prompt], SamplingParams(repetition_penalty=1e300, max_tokens=6, ignore_eos=True))
    assert huge[0].outputs[0].finish_reason == "length"


def test_logit_bias_1e308_forces_the_token(tiny_model):
    """The offline path (like gRPC) does not clamp to +-100: a huge bias still gives an answer."""
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=83)[0]
    for extra in (dict(temperature=0.0), dict(temperature=1.0, seed=4)):
        c = llm.generate([prompt], SamplingParams(logit_bias={67: 1e308}, max_tokens=4, ignore_eos=True, **extra))
        assert c[0].outputs[0].token_ids == [67] * 4
    # Banned by allowed_token_ids: -inf + a huge bias stays -inf (never NaN).
    c = llm.generate(
        [prompt],
        SamplingParams(
            logit_bias={67: 1e308}, allowed_token_ids=[5, 6], temperature=0.0, max_tokens=3, ignore_eos=True
        ),
    )[0].outputs[0]
    assert c.finish_reason == "length" and set(c.token_ids) <= {5, 6}


def test_processed_logprobs_with_allowed_ids_are_finite(tiny_model):
    llm = make_llm(tiny_model)
    prompt = prompts_of(tiny_model, 1, seed=84)[0]
    for temperature in (0.0, 1.0):
        c = llm.generate(
            [prompt],
            SamplingParams(
                allowed_token_ids=[5, 6],
                logprobs=3,
                logprobs_mode="processed_logprobs",
                temperature=temperature,
                max_tokens=4,
                ignore_eos=True,
                seed=1,
            ),
        )[0].outputs[0]
        assert c.finish_reason == "length"
        values = [lp.logprob for pos in c.logprobs for lp in pos.values()]
        assert LOGPROB_FLOOR in values and all(LOGPROB_FLOOR <= v <= 0.0 for v in values)
        json.dumps([*values, c.cumulative_logprob], allow_nan=False)


# -- +inf forces a token ---------------------------------------------------------------------------


def test_plus_inf_forces_a_token_greedy_and_random(tiny_model):
    llm = make_llm(tiny_model, logits_processors=[ForceTokensProcessor])
    prompt = prompts_of(tiny_model, 1, seed=85)[0]
    force = {"force": [700, 33, 2100]}
    greedy = llm.generate([prompt], SamplingParams(extra_args=force, **GREEDY))[0].outputs[0]
    assert greedy.token_ids == [33] * 8
    drawn = llm.generate(
        [prompt], SamplingParams(extra_args=force, temperature=1.0, max_tokens=16, ignore_eos=True, seed=9)
    )[0].outputs[0]
    assert drawn.finish_reason == "length" and set(drawn.token_ids) == {33, 700, 2100}
    again = llm.generate(
        [prompt], SamplingParams(extra_args=force, temperature=1.0, max_tokens=16, ignore_eos=True, seed=9)
    )[0].outputs[0]
    assert again.token_ids == drawn.token_ids


# -- a fault stays with its request ----------------------------------------------------------------


def _bystanders(loaded):
    prompts = prompts_of(loaded, 4, seed=86)
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=3, bad_words=["a"]),
    ]
    return prompts, params


def _run_with_culprits(loaded, processors, culprit_args: list[dict], join_at: int = 3) -> tuple[dict, LLMEngine]:
    """Bystanders start; after ``join_at`` steps the culprits join mid-flight; run to the end."""
    engine = LLMEngine(
        engine_config(max_num_seqs=8, load_entry_points=False, logits_processors=tuple(processors)), loaded=loaded
    )
    prompts, params = _bystanders(loaded)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"b{i}", p, sp)
    accs: dict[str, OutputAccumulator] = {}
    results = {}
    steps = 0
    while engine.has_unfinished() and steps < 200:
        if steps == join_at:
            for j, extra in enumerate(culprit_args):
                engine.add_request(f"c{j}", prompts[j], SamplingParams(extra_args=extra, **GREEDY))
        for out in engine.step():
            results[out.request_id] = accs.setdefault(out.request_id, OutputAccumulator()).add(out)
        steps += 1
    assert not engine.has_unfinished()
    return results, engine


@pytest.mark.parametrize(
    ("processors", "culprits", "phase"),
    [
        ([DummyLogitsProcessor], [{"target_token": 5000}], "IndexError"),
        ([RaisingLogitsProcessor], [{"raise_in": "apply"}], "apply"),
        ([RaisingLogitsProcessor], [{"raise_in": "update_state"}], "update_state"),
        ([DummyLogitsProcessor, RaisingLogitsProcessor], [{"target_token": 5000}, {"raise_in": "apply"}], "failed"),
    ],
    ids=["dummy-target-5000", "raise-apply", "raise-update-state", "two-culprits"],
)
def test_fault_stays_with_its_request(tiny_model, processors, culprits, phase):
    """The culprits fail alone; greedy and seeded bystanders equal their solo runs."""
    results, engine = _run_with_culprits(tiny_model, processors, culprits)
    for j in range(len(culprits)):
        c = results[f"c{j}"].outputs[0]
        assert c.finish_reason == "error" and phase in c.error
    prompts, params = _bystanders(tiny_model)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        c = results[f"b{i}"].outputs[0]
        assert c.finish_reason == "length", c.error
        assert c.token_ids == solo(tiny_model, p, sp), f"bystander {i}"
    assert engine.num_restarts >= 1 and engine.finish_counts["error"] == len(culprits)
    assert engine.num_running == 0 and engine.kv.stats()["blocks_used"] == 0


def test_nan_fails_only_its_row_and_names_the_processor(tiny_model):
    results, engine = _run_with_culprits(tiny_model, [NaNProcessor], [{"nan": True}])
    c = results["c0"].outputs[0]
    assert c.finish_reason == "error" and "NaN" in c.error and "NaNProcessor" in c.error
    prompts, params = _bystanders(tiny_model)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert results[f"b{i}"].outputs[0].token_ids == solo(tiny_model, p, sp)
    assert engine.num_restarts == 0  # a NaN row needs no rebuild


def test_update_state_failing_for_everyone_then_the_engine_goes_on(tiny_model):
    llm = make_llm(tiny_model, logits_processors=[ArmedUpdateStateProcessor])
    prompts = prompts_of(tiny_model, 3, seed=88)
    ArmedUpdateStateProcessor.armed = True
    try:
        outs = llm.generate(prompts, SamplingParams(**GREEDY))
    finally:
        ArmedUpdateStateProcessor.armed = False
    assert all(o.outputs[0].finish_reason == "error" and "armed" in o.outputs[0].error for o in outs)
    assert llm.engine.num_restarts >= 1
    ok = llm.generate(prompts, SamplingParams(**GREEDY))
    assert [o.outputs[0].token_ids for o in ok] == [solo(tiny_model, p, SamplingParams(**GREEDY)) for p in prompts]


class _FailingForward:
    """Wraps the real runner's ``execute``: the ``fail_at``-th call raises, the others run the model."""

    def __init__(self, execute, fail_at: int) -> None:
        self.execute, self.fail_at, self.calls = execute, fail_at, 0

    def __call__(self, seqs, feed=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected forward failure")
        return self.execute(seqs, feed)


def assert_serves_again(engine: LLMEngine, loaded, prompt: list[int]) -> None:
    """After a failure, a fresh greedy request gets exactly the tokens of its solo run."""
    engine.add_request("after", prompt, SamplingParams(**GREEDY))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
    assert tokens == solo(loaded, prompt, SamplingParams(**GREEDY))


def test_forward_failure_fails_its_rows_and_the_engine_goes_on(tiny_model):
    engine = LLMEngine(engine_config(max_num_seqs=4, load_entry_points=False), loaded=tiny_model)
    engine.runner.execute = _FailingForward(engine.runner.execute, fail_at=3)
    prompts = prompts_of(tiny_model, 2, seed=89)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(**GREEDY))
    finals = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
        if not engine.has_unfinished():
            break
    assert {r: c.finish_reason for r, c in finals.items()} == {"r0": "error", "r1": "error"}
    assert "model forward" in finals["r0"].error and "injected" in finals["r0"].error
    assert engine.kv.stats()["blocks_used"] == 0  # every KV block released
    assert_serves_again(engine, tiny_model, prompts[0])


def test_a_fault_no_replay_reproduces_fails_the_step_and_the_engine_goes_on(tiny_model):
    """No row can be blamed: the rows of that step fail (as before isolation existed)."""
    engine = LLMEngine(
        engine_config(max_num_seqs=4, load_entry_points=False, logits_processors=(FlakyApplyProcessor,)),
        loaded=tiny_model,
    )
    prompts = prompts_of(tiny_model, 2, seed=93)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(**GREEDY))
    engine.step()
    FlakyApplyProcessor.armed = True
    finals = {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    assert FlakyApplyProcessor.armed is False
    assert sorted(finals) == ["r0", "r1"]
    assert all(c.finish_reason == "error" and "FlakyApplyProcessor" in c.error for c in finals.values())
    assert engine.num_restarts == 1
    assert_serves_again(engine, tiny_model, prompts[0])


class _NaNForward:
    """Wraps the real runner's ``execute``: while two rows run, row 0's logits hold one NaN."""

    def __init__(self, execute) -> None:
        self.execute = execute

    def __call__(self, seqs, feed=None):
        logits = self.execute(seqs, feed)
        if logits.shape[0] == 2:
            logits[0, 7] = float("nan")
        return logits


def test_nan_from_the_model_is_named(tiny_model):
    engine = LLMEngine(engine_config(max_num_seqs=4, load_entry_points=False), loaded=tiny_model)
    engine.runner.execute = _NaNForward(engine.runner.execute)
    prompts = prompts_of(tiny_model, 2, seed=94)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(**GREEDY))
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert finals["r0"].finish_reason == "error"
    assert finals["r0"].error == "the logits held NaN (produced by the model)"
    assert finals["r1"].finish_reason == "length"


def test_a_row_whose_detokenizer_breaks_fails_alone(tiny_model):
    engine = LLMEngine(engine_config(max_num_seqs=4, load_entry_points=False), loaded=tiny_model)
    prompts = prompts_of(tiny_model, 2, seed=90)
    engine.add_request("bad", prompts[0], SamplingParams(**GREEDY))
    engine.add_request("good", prompts[1], SamplingParams(**GREEDY))
    engine.step()
    bad = engine._requests[next(r for r in engine._requests if r.startswith("bad"))]

    def broken(*a, **k):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    bad.detokenizer.update = broken
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert finals["bad"].finish_reason == "error" and "detokenize" in finals["bad"].error
    assert finals["good"].finish_reason == "length"


def test_async_engine_stays_healthy_after_faults(tiny_model):
    async def main():
        engine = AsyncEngine(
            engine_config(max_num_seqs=8, load_entry_points=False, logits_processors=(DummyLogitsProcessor,)),
            loaded=tiny_model,
        )
        prompts = prompts_of(tiny_model, 3, seed=91)

        async def run(rid, prompt, params):
            last = None
            async for out in engine.generate(rid, prompt, params):
                last = out
            return last.outputs[0]

        innocent = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        results = await asyncio.wait_for(
            asyncio.gather(
                run("innocent", prompts[0], innocent),
                *(
                    run(f"bad{i}", prompts[1], SamplingParams(extra_args={"target_token": 5000}, **GREEDY))
                    for i in range(3)
                ),
            ),
            120,
        )
        assert results[0].finish_reason == "length"
        assert results[0].token_ids == solo(tiny_model, prompts[0], innocent)
        assert all(r.finish_reason == "error" and "IndexError" in r.error for r in results[1:])
        assert engine.healthy()
        stats = engine.stats()
        assert stats.alive and stats.restarts >= 1 and stats.finished.get("error") == 3
        await engine.shutdown()

    asyncio.run(main())


def test_engine_is_dead_only_when_it_cannot_rebuild(tiny_model):
    """A failure that even a rebuild cannot get past: the loop stops and healthy() says so at once."""

    async def main():
        engine = AsyncEngine(engine_config(max_num_seqs=4, load_entry_points=False), loaded=tiny_model)
        prompt = prompts_of(tiny_model, 1, seed=92)[0]

        def broken():
            raise RuntimeError("cannot rebuild")

        engine.engine.scheduler.schedule = broken
        engine.engine._build_batch_state = broken
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("r", prompt, SamplingParams(**GREEDY)):
                pass
        assert not engine.healthy() and not engine.stats().alive
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))

"""AsyncEngine: concurrent streams share the batch; abort and consumer cancellation free the row."""

from __future__ import annotations

import asyncio

import pytest

from tests.worker.model_fixtures import engine_config
from tests.worker.test_engine import prompts_of
from worker import AsyncEngine, SamplingParams


def make_engine(loaded, **kw) -> AsyncEngine:
    return AsyncEngine(
        engine_config(max_num_seqs=kw.pop("max_num_seqs", 16), load_entry_points=False, **kw), loaded=loaded
    )


async def _steps_until(engine: AsyncEngine, cond, limit: int = 200) -> int:
    """Engine steps taken until cond() holds (bounded)."""
    start = engine.engine.num_steps
    for _ in range(limit * 100):
        if cond():
            return engine.engine.num_steps - start
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def test_concurrent_streams_share_the_batch(tiny_model):
    async def main():
        engine = make_engine(tiny_model)
        prompts = prompts_of(tiny_model, 8, seed=21)
        peak = 0

        async def one(i):
            nonlocal peak
            last = None
            async for out in engine.generate(
                f"s{i}", prompts[i], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            ):
                peak = max(peak, engine.num_running)
                last = out
            return last

        outs = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(8))), 120)
        await engine.shutdown()
        return outs, peak

    outs, peak = asyncio.run(main())
    assert all(o.finished and len(o.outputs[0].token_ids) == 10 for o in outs)
    assert peak >= 4, "streams should run in one batch"


def test_streamed_deltas_concatenate_to_the_final_output(tiny_model):
    async def main():
        engine = make_engine(tiny_model)
        prompt = prompts_of(tiny_model, 1, seed=22)[0]
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
        text, toks, n = "", [], 0
        async for d in engine.generate("d", prompt, params, delta=True):
            text += d.outputs[0].text
            toks += d.outputs[0].token_ids
            n += 1
        final = None
        async for c in engine.generate("c", prompt, params):
            final = c
        await engine.shutdown()
        return text, toks, n, final

    text, toks, n, final = asyncio.run(main())
    assert n > 1
    assert toks == final.outputs[0].token_ids
    assert text == final.outputs[0].text


def test_invalid_request_raises_before_admission(tiny_model):
    async def main():
        engine = make_engine(tiny_model)
        with pytest.raises(ValueError, match="allowed_token_ids"):
            async for _ in engine.generate("bad", [1, 2, 3], SamplingParams(allowed_token_ids=[10**9])):
                pass
        assert not engine.engine.has_unfinished()
        await engine.shutdown()

    asyncio.run(main())


def test_consumer_cancellation_and_abort_free_the_row(tiny_model):
    async def main():
        engine = make_engine(tiny_model)
        prompts = prompts_of(tiny_model, 2, seed=23)
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        agen = engine.generate("cancel-me", prompts[0], params)
        got = 0
        async for _ in agen:
            got += 1
            if got == 3:
                break
        await agen.aclose()
        steps = await _steps_until(engine, lambda: "cancel-me" not in engine.stats().batch_request_ids)
        assert steps <= 2  # the abort is seen at the next step start and removed in that step's update

        async def consume():
            async for _ in engine.generate("abort-me", prompts[1], params):
                pass

        task = asyncio.create_task(consume())
        await _steps_until(engine, lambda: "abort-me" in engine.stats().batch_request_ids)
        await engine.abort("abort-me")
        steps = await _steps_until(engine, lambda: "abort-me" not in engine.stats().batch_request_ids)
        assert steps <= 2
        await asyncio.wait_for(task, 30)
        assert engine.stats().kv["blocks_used"] == 0
        await engine.shutdown()

    asyncio.run(main())

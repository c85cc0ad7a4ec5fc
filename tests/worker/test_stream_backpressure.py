"""A stream whose consumer stops reading: AsyncEngine pauses its request once
``stream_buffer_outputs`` outputs wait undelivered (the engine stops producing for it, its KV is
kept, everyone else goes on), resumes it when the consumer reads again (the same tokens, no
recompute), and cancelling it frees everything. Bounds are counted in outputs and engine steps."""

from __future__ import annotations

import asyncio

from tests.worker.model_fixtures import engine_config
from tests.worker.test_engine import prompts_of
from worker.async_engine import AsyncEngine
from worker.model.runner import block_bytes
from worker.sampling_params import SamplingParams

BUFFER = 4
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)


def make_engine(loaded) -> AsyncEngine:
    return AsyncEngine(
        engine_config(max_num_seqs=4, load_entry_points=False, stream_buffer_outputs=BUFFER), loaded=loaded
    )


async def wait_for(cond, engine: AsyncEngine, steps: int = 400) -> None:
    """Until cond() holds, within a bounded number of engine steps (or an idle engine's checks)."""
    start = engine.engine.num_steps
    for _ in range(steps * 200):
        if cond():
            return
        assert engine.engine.num_steps - start <= steps, "condition never held"
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


def generated(engine: AsyncEngine, rid: str) -> int:
    """Tokens the engine has produced for a request so far (read between steps; a test's view)."""
    parent = engine.engine._parents.get(rid)
    return 0 if parent is None else sum(len(c.output_token_ids) for c in parent.children)


def test_a_stalled_stream_pauses_others_proceed_and_reading_resumes_it(tiny_model):
    async def main() -> None:
        engine = make_engine(tiny_model)
        prompts = prompts_of(tiny_model, 3, seed=61)
        stalled = engine.generate("stalled", prompts[0], LONG, delta=True)
        first = await stalled.__anext__()  # read once, then stop reading
        got = list(first.outputs[0].token_ids)
        await wait_for(lambda: engine.stats().num_paused == 1, engine)
        held = generated(engine, "stalled")
        # Paused at the bound (plus what the step in flight made): far from its 120 tokens.
        assert held <= 1 + BUFFER + 2, held
        assert engine.engine.scheduler.paused[0].block_ids, "a paused request keeps its KV"

        other = [
            o
            async for o in engine.generate(
                "other", prompts[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            )
        ]
        assert other[-1].finished and len(other[-1].outputs[0].token_ids) == 30
        assert generated(engine, "stalled") == held, "nothing is produced for a paused stream"
        steps = engine.engine.num_steps
        await asyncio.sleep(0.3)
        assert engine.engine.num_steps == steps, "an engine with only paused work does not spin"

        async for d in stalled:  # read again: it resumes and runs to the end
            got += d.outputs[0].token_ids
        assert len(got) == LONG.max_tokens
        assert engine.stats().kv["num_preemptions"] == 0, "resumed without a recompute"
        await engine.shutdown()
        # The reference is a fresh engine's unpaused run: on this engine the prompt's blocks are
        # cached now, and a prefix hit recomputes only the tail, in float32 sums of another shape.
        fresh = make_engine(tiny_model)
        again = [o async for o in fresh.generate("again", prompts[0], LONG)]
        await fresh.shutdown()
        assert again[-1].outputs[0].token_ids == got, "pausing changed the tokens"

    asyncio.run(main())


def test_cancelling_a_paused_stream_frees_its_row_and_blocks(tiny_model):
    async def main() -> None:
        engine = make_engine(tiny_model)
        prompts = prompts_of(tiny_model, 2, seed=62)
        stalled = engine.generate("stalled", prompts[0], LONG)
        await stalled.__anext__()
        await wait_for(lambda: engine.stats().num_paused == 1, engine)
        await stalled.aclose()
        await wait_for(lambda: engine.stats().num_paused == 0 and not engine.engine.has_unfinished(), engine)
        stats = engine.stats()
        assert stats.kv["blocks_used"] == 0 and stats.num_running == 0
        assert stats.finished.get("abort") == 1
        await engine.shutdown()

    asyncio.run(main())


def test_a_paused_requests_kv_is_the_first_to_go_when_blocks_run_short(tiny_model):
    """Idle streams never hold KV others need: a new request that finds no free block takes the
    paused one's, and the paused one recomputes when it resumes (same tokens)."""

    async def main() -> None:
        prompt_len, new, block = 24, 40, 8
        blocks = 2 * -(-(prompt_len + new) // block)  # room for two of the three requests at full length
        engine = AsyncEngine(
            engine_config(
                max_num_seqs=4,
                load_entry_points=False,
                stream_buffer_outputs=BUFFER,
                block_size=block,
                kv_cache_bytes=blocks * block_bytes(tiny_model, block),
            ),
            loaded=tiny_model,
        )
        assert engine.engine.kv.num_blocks == blocks
        prompts = prompts_of(tiny_model, 3, lo=prompt_len, hi=prompt_len + 1, seed=63)
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        stalled = engine.generate("stalled", prompts[0], params, delta=True)
        got = list((await stalled.__anext__()).outputs[0].token_ids)
        await wait_for(lambda: engine.stats().num_paused == 1, engine)
        outs = await asyncio.gather(*(_last(engine.generate(f"r{i}", prompts[i], params)) for i in (1, 2)))
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        assert engine.stats().kv["num_preemptions"] >= 1, "the paused request's blocks were taken"
        async for d in stalled:
            got += d.outputs[0].token_ids
        alone = await _last(engine.generate("alone", prompts[0], params))
        assert got == alone.outputs[0].token_ids
        await engine.shutdown()

    asyncio.run(main())


async def _last(agen):
    last = None
    async for o in agen:
        last = o
    return last


def test_a_pause_and_resume_before_one_step_leave_the_request_as_it_was(tiny_model):
    """A consumer that falls behind and catches up while one engine step runs: the pause and the
    resume both wait in the inbox for the next step. The pause took the row out of the batch (its
    removal pending for that step's update) and the resume put it back at once, so the update
    removed and re-added the same request: "already in the batch", the request failed (a loaded
    box did this to a served stream at random). Now the two cancel out: the row stays, and the
    tokens equal an unpaused run's."""
    from worker.engine import LLMEngine

    prompts = prompts_of(tiny_model, 2, seed=71)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(flips: set[int]) -> dict[str, list[int]]:
        engine = LLMEngine(engine_config(max_num_seqs=4, load_entry_points=False), loaded=tiny_model)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        tokens: dict[str, list[int]] = {"r0": [], "r1": []}
        step = 0
        while engine.has_unfinished():
            if step in flips:  # both in the inbox before the step (the rows are in the batch by now)
                engine.pause_request("r0")
                engine.resume_request("r0")
            for out in engine.step():
                assert out.outputs[0].error is None, out.outputs[0].error
                tokens[out.request_id] += out.outputs[0].token_ids
            step += 1
        assert engine.num_paused == 0
        return tokens

    want = run(set())
    assert run({3, 4, 10}) == want and len(want["r0"]) == 24

"""EngineProcess: the served engine loop in a child process (worker.engine_core), real tiny model.

The same tokens as the in-process AsyncEngine, the same stream semantics (abort by dropping the
iterator, ValueError before any output, backpressure pause/resume), and failure both ways: a
killed core fails every open stream, a dead parent takes its core with it. Bounds are generous
(seconds on a loaded 2-core box); nothing asserts speed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.worker.model_fixtures import engine_config, suite_device, tiny_model_path
from tests.worker.test_engine import prompts_of
from worker.async_engine import AsyncEngine, EngineDeadError
from worker.config import EngineConfig
from worker.engine_core import EngineProcess
from worker.engine_core.client.spawn import EngineStartError
from worker.model.runner import block_bytes
from worker.outputs import RequestOutput
from worker.sampling_params import SamplingParams

FAULTS = "tests.worker.fault_processors"
BUFFER = 4  # stream_buffer_outputs: small, so a stalled consumer pauses within a few steps
BLOCKS = 256
BLOCK_SIZE = 16
THREADS = 2
BOUND_S = 120.0  # any single wait in these tests (a loaded box stretches seconds, never this far)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)


def core_config(loaded) -> EngineConfig:
    return engine_config(
        model=str(tiny_model_path()),
        device=suite_device(),
        dtype="float32",
        max_num_seqs=8,
        load_entry_points=False,
        stream_buffer_outputs=BUFFER,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=BLOCKS * block_bytes(loaded, BLOCK_SIZE),
    )


@pytest.fixture(scope="module")
def core(tiny_model) -> Iterator[EngineProcess]:
    ep = EngineProcess(core_config(tiny_model), num_threads=THREADS)
    yield ep
    ep.close()


def gone(pid: int) -> bool:
    """No such process, or only its zombie (a reaper may be slow): it runs no more."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


async def until(cond: Callable[[], bool], bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def collect(engine, rid: str, prompt: list[int], params: SamplingParams) -> RequestOutput:
    last = None
    async for out in engine.generate(rid, prompt, params):
        last = out
    assert last is not None and last.finished
    return last


def test_ready_reports_the_core(core, tiny_model):
    assert core.pid != os.getpid() and not gone(core.pid)
    assert core.num_threads == THREADS, "the core runs torch on the CPUs it was given"
    assert core.kv_cache_bytes == BLOCKS * block_bytes(tiny_model, BLOCK_SIZE)
    assert core.rank_pids() == []
    assert "worker.logits_processor.builtin:MinPLogitsProcessor" in core.processor_fqcns
    assert core.healthy() and core.stats().alive


def test_start_up_errors_are_raised_in_the_parent(tiny_model):
    """A bad config is a ValueError naming the field (with the core's traceback); a core that
    dies before Ready (no message) is an EngineStartError with its exit code; neither hangs."""
    with pytest.raises(ValueError, match="kv_cache_bytes") as bad:
        EngineProcess(dataclasses.replace(core_config(tiny_model), kv_cache_bytes=1), start_timeout_s=BOUND_S)
    assert "engine core traceback" in str(bad.value)
    died = dataclasses.replace(core_config(tiny_model), logits_processors=(f"{FAULTS}:ExitAtStartProcessor",))
    with pytest.raises(EngineStartError, match="exit code 7"):
        EngineProcess(died, start_timeout_s=BOUND_S)


def test_same_greedy_and_seeded_tokens_as_in_process(core, tiny_model):
    prompts = prompts_of(tiny_model, 3, seed=301)  # prompts neither engine has cached
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)

    async def run(engine) -> list[RequestOutput]:
        outs = []
        for i, p in enumerate(prompts):
            outs.append(await collect(engine, f"g{i}", p, GREEDY))
            outs.append(await collect(engine, f"s{i}", p, seeded))
        return outs

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        local = AsyncEngine(core_config(tiny_model), loaded=tiny_model)
        want = await asyncio.wait_for(run(local), BOUND_S)
        await local.shutdown()
        return want, await asyncio.wait_for(run(core), BOUND_S)

    want, got = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert all(len(o.outputs[0].token_ids) == 12 for o in got)
    assert [o.prompt_token_ids for o in got[::2]] == prompts, "the parent restores the prompt ids"


def test_many_concurrent_streams(core, tiny_model):
    prompts = prompts_of(tiny_model, 20, seed=302)

    async def main() -> tuple[list[tuple[list[int], bool]], int]:
        peak = 0

        async def one(i: int) -> tuple[list[int], bool]:
            nonlocal peak
            toks: list[int] = []
            finished = False
            async for d in core.generate(f"c{i}", prompts[i], GREEDY, delta=True):
                peak = max(peak, core.num_running)
                toks += d.outputs[0].token_ids
                finished = d.finished
            return toks, finished

        outs = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(20))), BOUND_S)
        return outs, peak

    outs, peak = asyncio.run(main())
    assert all(finished and len(toks) == 12 for toks, finished in outs)
    assert peak >= 4, "streams share the core's batch"


def test_dropping_the_iterator_aborts_and_frees_the_row(core, tiny_model):
    prompt = prompts_of(tiny_model, 1, seed=303)[0]

    async def main() -> None:
        aborted = Counter(core.stats().finished)["abort"]
        it = core.generate("dropped", prompt, LONG, delta=True)
        await asyncio.wait_for(it.__anext__(), BOUND_S)
        await it.aclose()  # the consumer stops iterating
        await until(lambda: core.stats().num_running == 0 and "abort" in core.stats().finished)
        assert core.stats().finished["abort"] == aborted + 1
        assert "dropped" not in core.stats().batch_request_ids
        again = await asyncio.wait_for(collect(core, "dropped", prompt, GREEDY), BOUND_S)  # the id is free
        assert len(again.outputs[0].token_ids) == 12

    asyncio.run(main())


def test_invalid_request_is_a_value_error_and_the_core_still_serves(core, tiny_model):
    prompt = prompts_of(tiny_model, 1, seed=304)[0]

    async def main() -> None:
        with pytest.raises(ValueError, match="allowed_token_ids"):
            async for _ in core.generate("bad", prompt, SamplingParams(max_tokens=4, allowed_token_ids=[10**7])):
                raise AssertionError("no output before the error")
        with pytest.raises(ValueError, match="prompt"):
            async for _ in core.generate("bad-ids", [tiny_model.vocab_size + 5], GREEDY):
                raise AssertionError("no output before the error")
        out = await asyncio.wait_for(collect(core, "good", prompt, GREEDY), BOUND_S)
        assert len(out.outputs[0].token_ids) == 12
        assert core.healthy()

    asyncio.run(main())


def test_a_structured_request_compiles_off_the_core_loop_and_conforms(core, tiny_model):
    prompt = prompts_of(tiny_model, 1, seed=308)[0]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured_outputs={"choice": ["yes", "no"]})  # type: ignore[arg-type]  # a dict, as a request gives it

    async def main() -> RequestOutput:
        return await asyncio.wait_for(collect(core, "structured", prompt, params), BOUND_S)

    out = asyncio.run(main())
    assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop"


def test_a_stalled_consumer_pauses_its_request_and_reading_resumes_it(core, tiny_model):
    prompts = prompts_of(tiny_model, 2, seed=305)

    async def main() -> list[int]:
        stalled = core.generate("stalled", prompts[0], LONG, delta=True)
        first = await asyncio.wait_for(stalled.__anext__(), BOUND_S)  # read once, then stop reading
        got = list(first.outputs[0].token_ids)
        await until(lambda: core.stats().num_paused == 1)
        other = await asyncio.wait_for(collect(core, "other", prompts[1], GREEDY), BOUND_S)
        assert len(other.outputs[0].token_ids) == 12, "the others go on"
        assert core.stats().num_paused == 1, "still paused while nobody reads"
        async for d in stalled:  # read again: it resumes and runs to the end
            got += d.outputs[0].token_ids
        assert core.stats().num_paused == 0
        assert core.stats().kv["num_preemptions"] == 0, "resumed without a recompute"
        return got

    got = asyncio.run(asyncio.wait_for(main(), 2 * BOUND_S))
    assert len(got) == LONG.max_tokens

    async def fresh() -> list[int]:  # an unpaused run of the same prompt, on a cold cache
        local = AsyncEngine(core_config(tiny_model), loaded=tiny_model)
        out = await collect(local, "again", prompts[0], LONG)
        await local.shutdown()
        return out.outputs[0].token_ids

    assert asyncio.run(fresh()) == got, "pausing changed the tokens"


def test_cached_blocks_reports_the_core_prefix_cache(core, tiny_model):
    prompt = prompts_of(tiny_model, 1, lo=70, hi=71, seed=306)[0]

    async def main() -> None:
        await asyncio.wait_for(collect(core, "cached", prompt, GREEDY), BOUND_S)
        cached = await core.cached_blocks()
        assert cached.num_blocks == BLOCKS
        assert len(cached.addresses) >= len(prompt) // BLOCK_SIZE
        assert 0 < cached.num_free <= BLOCKS

    asyncio.run(main())


def test_a_killed_core_fails_every_stream_and_health(tiny_model):
    ep = EngineProcess(core_config(tiny_model), num_threads=1)
    prompts = prompts_of(tiny_model, 3, seed=307)

    async def main() -> list[BaseException | None]:
        iters = [ep.generate(f"k{i}", p, LONG, delta=True) for i, p in enumerate(prompts)]
        for it in iters:
            await asyncio.wait_for(it.__anext__(), BOUND_S)  # every stream is open and streaming
        os.kill(ep.pid, signal.SIGKILL)  # a real failure (OOM killer, segfault)

        async def drain(it) -> BaseException | None:
            try:
                async for _ in it:
                    pass
            except EngineDeadError as exc:
                return exc
            return None

        return await asyncio.wait_for(asyncio.gather(*(drain(it) for it in iters)), BOUND_S)

    try:
        errors = asyncio.run(main())
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert ep.dead is not None and not ep.healthy() and not ep.stats().alive
        assert gone(ep.pid)

        async def after() -> None:
            with pytest.raises(EngineDeadError):
                async for _ in ep.generate("late", prompts[0], GREEDY):
                    pass
            with pytest.raises(EngineDeadError):
                await ep.cached_blocks()

        asyncio.run(after())
    finally:
        ep.close()


PARENT = """
import os, sys
import ray  # what a replica's main module holds: the core must not follow it
from worker.config import EngineConfig
from worker.engine_core import EngineProcess
from worker.engine_core.client.spawn import EngineStartError

if __name__ == "__main__":
    ep = EngineProcess(EngineConfig(**{kwargs!r}), num_threads=1)
    print(ep.pid, int(ep.ray_imported), flush=True)
    os._exit(0)  # dies without closing anything, as a killed replica would
"""


def test_a_dead_parent_takes_its_core_with_it(tiny_model, tmp_path):
    kwargs = core_config(tiny_model).as_kwargs()
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT.format(kwargs=kwargs)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=BOUND_S * 2, env=env, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    pid_s, ray_s = proc.stdout.split()
    pid = int(pid_s)
    assert ray_s == "0", "the core imported ray (the parent's main module followed it)"
    deadline = time.monotonic() + BOUND_S
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pid), "the core outlived its parent"

"""One OpenMP team per engine process (worker.model.host_threads): work run through
``on_own_thread`` leaves no OpenMP workers behind, and an AsyncEngine is built that way, so the
thread that built it holds none beside the engine thread's.

The probes run in fresh processes: whether a thread holds a team shows as whether its first
parallel op starts a worker thread (with 2 torch threads: one worker), and the test process's own
threads already hold teams.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from worker.model.host_threads import on_own_thread

COUNT = textwrap.dedent(
    """
    import os, threading, torch
    torch.set_num_threads(2)

    def tids() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    def threads() -> int:
        return len(tids())

    def parallel_op() -> None:
        torch.ones(1 << 20).mul_(2)  # past the grain size: runs as an OpenMP parallel region

    def gained_by_parallel_op() -> int:
        # Threads the op started (ones ending meanwhile, as a finished thread's team does, aside).
        before = tids()
        parallel_op()
        return len(tids() - before)
    """
)


def _run(code: str, *args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", COUNT + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return out.stdout.split()


def test_on_own_thread_returns_the_result_and_raises_the_error_of_a_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def where(x: int) -> int:
        seen.append(threading.current_thread())
        return x + 1

    assert on_own_thread(where, 1) == 2
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    class Boom(Exception):
        pass

    err = Boom("at start-up")

    def fail() -> None:
        raise err

    with pytest.raises(Boom) as info:
        on_own_thread(fail)
    assert info.value is err


def test_a_thread_that_ends_takes_its_openmp_workers_with_it() -> None:
    kept, ended = _run(
        """
        import threading, time
        from worker.model.host_threads import on_own_thread

        start = threads()
        on_own_thread(parallel_op)
        deadline = time.monotonic() + 60
        while threads() > start and time.monotonic() < deadline:  # its worker exits after it
            time.sleep(0.01)
        ended = threads() - start
        hold = threading.Event()
        def stays() -> None:
            parallel_op()
            hold.wait()
        t = threading.Thread(target=stays, daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while threads() < start + 2 and time.monotonic() < deadline:  # the thread and its worker
            time.sleep(0.01)
        print(threads() - start, ended)
        hold.set()
        t.join()
        """
    )
    assert int(kept) == 2, "a live thread that ran a parallel op keeps its OpenMP worker"
    assert int(ended) == 0, "on_own_thread's thread took its worker with it"


def test_the_thread_that_builds_an_async_engine_holds_no_openmp_team(tiny_model_dir) -> None:
    built, served = _run(
        """
        import asyncio, sys
        from worker.async_engine import AsyncEngine
        from worker.config import EngineConfig
        from worker.sampling_params import SamplingParams

        engine = AsyncEngine(EngineConfig(model=sys.argv[1], kv_cache_bytes=1 << 22, load_entry_points=False))
        built = gained_by_parallel_op()  # 1: this thread had no team; 0: building left one here

        async def one() -> None:
            async for _ in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=4)):
                pass
            await engine.shutdown()

        asyncio.run(one())
        print(built, gained_by_parallel_op())
        """,
        str(tiny_model_dir),
    )
    assert built == "1", "loading, profiling and the KV pool ran on a thread that ended"
    assert served == "0", "the probe's own team is still here: a second parallel op starts no worker"


def test_a_large_vocabulary_token_bitmask_is_built_without_an_openmp_team() -> None:
    """The structured compiler builds its masks on whichever thread prepares a request."""
    (gained,) = _run(
        """
        from worker.logits_processor.structured_grammar import _bits_of

        before = tids()
        _bits_of(range(0, 128_256, 3), 128_256)  # Llama 3's vocabulary
        print(len(tids() - before))
        """
    )
    assert gained == "0"

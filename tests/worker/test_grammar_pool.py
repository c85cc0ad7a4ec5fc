"""GrammarPool: constraints compiled in sandbox processes, killed at their bounds, in lanes that
keep trivial constraints served while heavy ones run (issue 17, item 3).

Outcomes and counts are asserted, never durations: the bounds under test are seconds, and every
wait of the tests themselves is a generous liveness bound for a loaded 2-core box.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from cluster.limits import Limits, check_request
from worker.logits_processor.grammar_pool import GrammarPool, PoolConfig
from worker.logits_processor.structured_grammar import CompileBusy, StructuredCompiler
from worker.sampling_params import SamplingParams
from worker.structured_outputs import MAX_CONSTRAINT_BYTES, StructuredOutputsParams

VOCAB = ["<eos>"] + [chr(i) for i in range(32, 127)]
EOS = 0
WAIT_S = 120.0
REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def heavy(i: int = 0) -> StructuredOutputsParams:
    """46 bytes that xgrammar 0.2.8 compiles for minutes (it unrolls counts up to 20000)."""
    return StructuredOutputsParams(json={"type": "string", "pattern": f"^(a|b){{1,{19999 - i}}}$"})


# Compiles in well under a second, but never in 10 ms: it overruns a tiny light_s.
MEDIUM = StructuredOutputsParams(json={"type": "string", "pattern": "^(a|b){1,1000}$"})


def regex(text: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=text)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def eventually(probe: Callable[[], T | None], what: str) -> T:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {WAIT_S}s: {what}")


def compiler(pool: GrammarPool, **kw: float) -> StructuredCompiler:
    return StructuredCompiler.from_vocab(VOCAB, [EOS], pool=pool, **kw)  # type: ignore[arg-type]  # kw: the compiler's own numeric options


def in_thread(fn: Callable[[], object], out: list[object]) -> threading.Thread:
    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.fixture
def pools() -> list[GrammarPool]:
    """Pools made by a test; shut down after it, and then none of their processes may be left."""
    made: list[GrammarPool] = []
    yield made
    pids: set[int] = set()
    for p in made:
        pids |= p.stats().pids
        p.shutdown()
    assert not [pid for pid in pids if alive(pid)]


def new_pool(pools: list[GrammarPool], **kw: float) -> GrammarPool:
    pool = GrammarPool(PoolConfig(**kw))  # type: ignore[arg-type]  # kw: PoolConfig's own numeric fields
    pools.append(pool)
    return pool


def test_heavy_compile_is_killed_at_its_bound_and_its_process_replaced(pools: list[GrammarPool]) -> None:
    pool = new_pool(pools, light_s=0.5)
    c = compiler(pool, timeout_s=2.0)
    c.compile(regex("a+"))
    before = pool.stats().pids  # the worker that compiled, and a warm spare
    with pytest.raises(ValueError, match=r"^structured_outputs.json: compiling the JSON schema took longer than 2s"):
        c.compile(heavy())
    killed = [p for p in before if not alive(p)]  # killed, not left compiling: its CPU and memory are back
    assert len(killed) == 1 and pool.stats().kills == 1
    assert len(c) == 1  # nothing of the killed compile was cached
    assert c.compile(regex("b+")) is not None  # the others serve on
    assert killed[0] not in pool.stats().pids


def test_a_compile_over_the_memory_budget_is_a_value_error_and_the_pool_lives_on(pools: list[GrammarPool]) -> None:
    pool = new_pool(pools, memory_bytes=8 << 20)
    c = compiler(pool)
    big = StructuredOutputsParams(json={"enum": [f"v{i:06d}x" for i in range(5000)]})  # ~16 MB to compile
    assert c.compile(regex("a+")) is not None
    with pytest.raises(
        ValueError,
        match=r"^structured_outputs.json: compiling the JSON schema needs more than the "
        r"8 MiB compile memory budget",
    ):
        c.compile(big)
    jobs = pool.stats().jobs
    with pytest.raises(ValueError, match="8 MiB compile memory budget"):
        c.compile(big)  # remembered: a client repeating it costs no compile
    assert pool.stats().jobs == jobs
    assert c.compile(regex("b+")) is not None  # the pool lives on
    assert compiler(new_pool(pools)).compile(big) is not None  # the budget's doing, not the schema's


def test_trivial_constraints_succeed_while_heavy_ones_run(pools: list[GrammarPool]) -> None:
    pool = new_pool(pools, light_s=0.5, heavy_workers=2)
    heavy_c, trivial_c = compiler(pool, timeout_s=300.0), compiler(pool)
    results: list[object] = []
    threads = [in_thread(lambda i=i: heavy_c.compile(heavy(i)), results) for i in range(3)]
    eventually(lambda: pool.stats().heavy_running == 2, "two heavy compiles running")
    for i in range(8):  # distinct, so each one is compiled, not found in the cache
        assert trivial_c.compile(regex(f"x{i}+")) is not None
        assert pool.stats().heavy_running == 2  # ... while the heavy ones still ran
    assert trivial_c.misses == 8
    pool.shutdown()  # kills the heavy compiles
    for t in threads:
        t.join(WAIT_S)
    assert len(results) == 3 and all(isinstance(r, Exception) for r in results)


def test_a_bound_counts_from_its_own_compile_and_heavy_constraints_are_remembered(pools: list[GrammarPool]) -> None:
    pool = new_pool(pools, light_s=0.01, heavy_workers=1)
    slow_c, medium_c = compiler(pool, timeout_s=3.0), compiler(pool, timeout_s=60.0)
    slow: list[object] = []
    t = in_thread(lambda: slow_c.compile(heavy()), slow)
    eventually(lambda: pool.stats().heavy_running == 1, "the heavy lane taken")
    # MEDIUM overruns light_s with the heavy lane taken: killed, then run afresh there once free.
    assert medium_c.compile(MEDIUM) is not None
    t.join(WAIT_S)
    assert isinstance(slow[0], ValueError) and "took longer than 3s" in str(slow[0])
    assert pool.stats().kills == 2  # the slow one at its bound, MEDIUM once at light_s
    medium_c.clear()
    assert medium_c.compile(MEDIUM) is not None  # known heavy: straight to the (free) heavy lane
    assert pool.stats().kills == 2


def test_a_compile_that_waits_past_the_queue_bound_is_busy(pools: list[GrammarPool]) -> None:
    pool = new_pool(pools, light_s=0.01, heavy_workers=1, queue_wait_s=0.5)
    slow: list[object] = []
    in_thread(lambda: compiler(pool, timeout_s=300.0).compile(heavy()), slow)
    eventually(lambda: pool.stats().heavy_running == 1, "the heavy lane taken")
    with pytest.raises(CompileBusy, match=r"^structured_outputs.json: every grammar compile worker is busy") as info:
        compiler(pool, timeout_s=60.0).compile(MEDIUM)
    assert info.value.http_status == 503


def test_invalid_constraint_is_remembered(pools: list[GrammarPool]) -> None:
    pool = new_pool(pools)
    c = compiler(pool)
    for _ in range(3):
        with pytest.raises(ValueError, match=r"^structured_outputs.regex: invalid regex: .*parenthesis"):
            c.compile(regex("(a"))
    assert pool.stats().jobs == 1 and c.hits == 2 and c.misses == 1


def test_oversize_constraints_are_rejected_before_compiling(pools: list[GrammarPool]) -> None:
    pool = new_pool(pools)
    c = compiler(pool, max_spec_bytes=64)
    so = StructuredOutputsParams(json={"enum": ["x" * 100]}, source="response_format.json_schema.schema")
    with pytest.raises(
        ValueError,
        match=rf"^response_format.json_schema.schema: the JSON schema is {len(so.spec)} "
        r"bytes, over the 64 bytes a constraint may have \(max_constraint_bytes\)",
    ):
        c.compile(so)
    with pytest.raises(ValueError, match=f"over the {MAX_CONSTRAINT_BYTES} bytes"):
        compiler(pool).compile(regex("a" * (MAX_CONSTRAINT_BYTES + 1)))
    assert c.misses == 0 and pool.stats() == type(pool.stats())()  # no worker was even started


def test_the_ingress_bounds_constraints_by_limits() -> None:
    params = SamplingParams(structured_outputs={"json": {"enum": ["x" * 100]}})  # type: ignore[arg-type]  # a dict, as a request gives it (validated into the params)
    size = len(params.structured_outputs.spec)  # type: ignore[union-attr]  # set on the line above
    with pytest.raises(
        ValueError, match=rf"^structured_outputs.json: {size} bytes exceeds limits.max_constraint_bytes \(64\)"
    ):
        check_request(Limits(max_constraint_bytes=64), params, 1)
    check_request(Limits(), params, 1)
    assert Limits().max_constraint_bytes == MAX_CONSTRAINT_BYTES  # stated once, engine side


def test_shutdown_leaves_no_process_and_a_later_compile_starts_afresh(pools: list[GrammarPool]) -> None:
    pool = new_pool(pools)
    c = compiler(pool)
    c.compile(regex("a+"))
    first = pool.stats().pids
    assert first and all(alive(p) for p in first)
    pool.shutdown()
    assert not [p for p in first if alive(p)] and pool.stats().pids == frozenset()
    assert c.compile(regex("b+")) is not None
    assert pool.stats().pids and not pool.stats().pids & first


_ORPHAN = """
import json, sys, threading, time
from worker.logits_processor.grammar_pool import GrammarPool
from worker.logits_processor.structured_grammar import StructuredCompiler
from worker.structured_outputs import StructuredOutputsParams
pool = GrammarPool()
c = StructuredCompiler.from_vocab(["<eos>", "a", "b"], [0], pool=pool, timeout_s=600)
so = StructuredOutputsParams(json={"type": "string", "pattern": "^(a|b){1,19999}$"})
threading.Thread(target=lambda: c.compile(so), daemon=True).start()
while pool.stats().heavy_running < 1:
    time.sleep(0.02)
print(json.dumps(sorted(pool.stats().pids)), flush=True)
time.sleep(600)
"""


def test_workers_die_with_their_parent_even_mid_compile() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, env=env, cwd=REPO)
    try:
        assert parent.stdout is not None
        # Bounded: a pool whose manager never starts a worker must fail this test, not hang it.
        ready, _, _ = select.select([parent.stdout], [], [], WAIT_S)
        assert ready, f"the orphaning parent printed no worker pids within {WAIT_S}s"
        pids = json.loads(parent.stdout.readline())
        assert pids and all(alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait(WAIT_S)
    eventually(lambda: not any(alive(p) for p in pids), "the orphaned workers gone")

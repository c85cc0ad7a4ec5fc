"""GrammarPool: constraints compiled in sandbox processes that are killed at their bounds.

Why processes: an xgrammar compile cannot be interrupted. In a thread, one that overran its
bound kept its core and its memory until it finished (issue 17: a 600 KB grammar held ~5 GB and
1.3 cores for 15 minutes after its 10 s timeout). Here each compile runs in a worker process
(``grammar_worker``) with an address-space cap; the pool's manager thread kills the process when
its compile overruns (its CPU and memory are back at once) and starts another when one is needed.
Processes start lazily, on the first compile, and retire after ``idle_s`` without work.

Lanes (fairness): every job first runs in the light lane, for at most ``light_s``; one still
compiling then is heavy and continues if fewer than ``heavy_workers`` heavy jobs run, else it is
killed and waits for a heavy slot, to start afresh with its whole bound (a bound always counts
from its own compile's start, never from queueing). Heavy jobs never hold more than
``heavy_workers`` processes, so ``light_workers`` processes always serve light jobs, smallest spec
first: a trivial constraint waits at most ``light_s`` per light job queued before it, whatever
heavy work is running. A constraint once found heavy goes straight to the heavy lane next time.
Every queue wait is bounded too: past ``queue_wait_s`` with every worker started and busy, the
verdict is BUSY (while a worker is starting, ``start_timeout_s`` bounds the wait instead).

The verdict says only whether (and how) the constraint compiles; the caller then compiles it
again in its own process (``grammar_worker.compile_spec``), a computation known to finish within
the bounds. Shipping xgrammar's serialized grammar back would cost more than compiling twice:
measured, a 40-pattern schema compiles in 20 ms and serializes in 1 s; at 200 patterns 0.5 s
against 64 s to serialize and 47 s to deserialize (166 MB: every per-rule FSM carries a copy of
the whole grammar's FSM), and the deserialized copies no longer share it.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import heapq
import itertools
import json
import logging
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.logits_processor.grammar_worker import INFOS_KEPT

logger = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("grammar_worker.py")
_FUSE_S = 5.0  # the worker's own CPU cap lies this far past the pool's kill
_HEAVY_KEYS = 1024
_START_FAILURES = 3


class Outcome(enum.Enum):
    OK = "ok"
    INVALID = "invalid"  # the grammar library rejected the constraint
    MEMORY = "memory"  # it needed more than the memory budget
    TIMEOUT = "timeout"  # its compile ran past its bound and was killed
    CRASHED = "crashed"  # the worker died compiling it
    BUSY = "busy"  # it waited past queue_wait_s for a worker
    UNAVAILABLE = "unavailable"  # no worker could be started, or the pool shut down


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    message: str = ""


@dataclass(frozen=True)
class PoolConfig:
    """The pool's bounds (the defaults are the process-wide pool's)."""

    light_workers: int = 1
    heavy_workers: int = 1
    light_s: float = 1.0
    memory_bytes: int = 1 << 30
    """Address space a worker may add to what it holds after its imports."""
    queue_wait_s: float = 30.0
    start_timeout_s: float = 60.0
    idle_s: float = 300.0


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool, taken by its manager thread after each event."""

    pids: frozenset[int] = frozenset()  # worker processes alive
    light_running: int = 0
    heavy_pids: frozenset[int] = frozenset()  # the workers running heavy compiles
    queued: int = 0
    jobs: int = 0  # compiles handed to a worker so far
    kills: int = 0  # workers killed because their compile ran past a bound (light_s or its timeout)

    @property
    def heavy_running(self) -> int:
        return len(self.heavy_pids)


@dataclass(frozen=True)
class TokenizerSnapshot:
    """A tokenizer as a worker rebuilds it: ``xgr.TokenizerInfo.serialize_json`` and its key."""

    key: str
    json: str


@dataclass
class _Task:
    kind: str
    spec: str
    info: TokenizerSnapshot
    timeout_s: float
    seq: int
    heavy: bool = False
    queued_at: float = 0.0
    requeued: bool = False  # once, after a worker died before it started this task
    done: threading.Event = field(default_factory=threading.Event)
    verdict: Verdict | None = None

    def finish(self, verdict: Verdict) -> None:
        if self.verdict is None:
            self.verdict = verdict
            self.done.set()

    def light_order(self) -> tuple[int, int]:
        return (len(self.spec), self.seq)

    def __lt__(self, other: _Task) -> bool:
        return self.light_order() < other.light_order()


@dataclass
class _Proc:
    popen: subprocess.Popen[bytes]
    since: float  # spawned, dispatched or idle since
    ready: bool = False
    task: _Task | None = None
    heavy: bool = False
    started_at: float | None = None  # the current job's compile start
    buf: bytes = b""
    infos: OrderedDict[str, None] = field(default_factory=OrderedDict)

    @property
    def fd(self) -> int:
        assert self.popen.stdout is not None
        return self.popen.stdout.fileno()


class GrammarPool:
    """Runs constraint compiles in worker processes; ``run`` answers within ``answer_within_s``."""

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = config or PoolConfig()
        self._lock = threading.Lock()  # guards starting and stopping the manager thread only
        self._manager: _Manager | None = None
        self._seq = itertools.count()

    def run(self, kind: str, spec: str, info: TokenizerSnapshot, timeout_s: float) -> Verdict:
        task = _Task(kind, spec, info, timeout_s, next(self._seq))
        self._started().submit(task)
        if not task.done.wait(self.answer_within_s(timeout_s)):
            return Verdict(Outcome.UNAVAILABLE, "the compile pool did not answer")
        assert task.verdict is not None
        return task.verdict

    def answer_within_s(self, timeout_s: float) -> float:
        c = self.config
        return 2 * c.queue_wait_s + 2 * c.start_timeout_s + c.light_s + timeout_s + _FUSE_S

    def stats(self) -> PoolStats:
        """What the pool holds now (for tests and benchmarks); empty when not started."""
        m = self._manager
        return m.stats if m is not None else PoolStats()

    def shutdown(self) -> None:
        """Kill every worker and stop; a later ``run`` starts afresh."""
        with self._lock:
            m, self._manager = self._manager, None
        if m is not None:
            m.stop()

    def _started(self) -> _Manager:
        with self._lock:
            if self._manager is None or not self._manager.alive:
                self._manager = _Manager(self.config)
            return self._manager


class _Manager:
    """The thread that owns the workers and the queues; nothing else touches them."""

    def __init__(self, config: PoolConfig) -> None:
        self.c = config
        self.inbox: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self._wake_r, selectors.EVENT_READ, None)
        self.procs: list[_Proc] = []
        self.light: list[_Task] = []
        self.heavy: deque[_Task] = deque()
        self.heavy_keys: OrderedDict[int, None] = OrderedDict()
        self.mode = "lean"
        self.start_failures = 0
        self.last_submit = -float("inf")
        self.stats = PoolStats()
        self.jobs = 0
        self.kills = 0
        self.alive = True
        self._closed = False
        self._wake_lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="logitpool-grammar-pool", daemon=True)
        self.thread.start()

    # -- the caller's side -----------------------------------------------------------------

    def submit(self, task: _Task | None) -> None:
        with self._wake_lock:  # never a write to the wake pipe once it is closed (its fd may be reused)
            if not self._closed:
                self.inbox.put(task)
                with contextlib.suppress(BlockingIOError):  # the pipe is full: the loop is about to wake anyway
                    os.write(self._wake_w, b"\0")
                return
        if task is not None:
            task.finish(Verdict(Outcome.UNAVAILABLE, "the compile pool shut down"))

    def stop(self) -> None:
        self.submit(None)
        self.thread.join(30.0)

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._step():
                pass
        except BaseException:  # a bug here must not leave workers or callers behind (finally)
            logger.exception("grammar pool manager failed")
        finally:
            self.alive = False
            self._close()

    def _step(self) -> bool:
        for key, _ in self.sel.select(self._next_deadline()):
            if key.data is None:
                if not self._drain():
                    return False
            else:
                self._read(key.data)
        self._expire(time.monotonic())
        self._dispatch(time.monotonic())
        heavy = frozenset(p.popen.pid for p in self.procs if p.task is not None and p.heavy)
        self.stats = PoolStats(
            frozenset(p.popen.pid for p in self.procs),
            sum(1 for p in self.procs if p.task is not None) - len(heavy),
            heavy,
            len(self.light) + len(self.heavy),
            self.jobs,
            self.kills,
        )
        return True

    def _drain(self) -> bool:
        os.read(self._wake_r, 4096)
        now = time.monotonic()
        while True:
            try:
                task = self.inbox.get_nowait()
            except queue.Empty:
                return True
            if task is None:
                return False
            task.queued_at = self.last_submit = now
            task.heavy = hash((task.kind, task.spec)) in self.heavy_keys
            self._enqueue(task)

    def _enqueue(self, task: _Task) -> None:
        if task.heavy:
            self.heavy.append(task)
        else:
            heapq.heappush(self.light, task)

    def _close(self) -> None:
        with self._wake_lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
        gone = Verdict(Outcome.UNAVAILABLE, "the compile pool shut down")
        for p in list(self.procs):
            self._kill(p, gone)
        self._fail_queued(gone)
        while not self.inbox.empty():
            t = self.inbox.get_nowait()
            if t is not None:
                t.finish(gone)
        self.stats = PoolStats(jobs=self.jobs, kills=self.kills)
        self.sel.close()

    # -- bounds ------------------------------------------------------------------------------

    def _light_bound(self, task: _Task) -> float:
        return min(self.c.light_s, task.timeout_s)

    def _deadlines(self, p: _Proc) -> float:
        """When ``p`` next needs attention (inf: only when it says something)."""
        if not p.ready or (p.task is not None and p.started_at is None):
            return p.since + self.c.start_timeout_s
        if p.task is None:
            return p.since + self.c.idle_s
        assert p.started_at is not None
        return p.started_at + (p.task.timeout_s if p.heavy else self._light_bound(p.task))

    def _next_deadline(self) -> float | None:
        times = [self._deadlines(p) for p in self.procs]
        if all(p.ready for p in self.procs):
            times += [t.queued_at + self.c.queue_wait_s for t in [*self.light, *self.heavy]]
        return max(0.0, min(times) - time.monotonic()) if times else None

    def _expire(self, now: float) -> None:
        for p in list(self.procs):
            if now >= self._deadlines(p):
                self._overran(p, now)
        if any(not p.ready for p in self.procs):
            return  # a worker is starting (start_timeout_s bounds that): the wait is the pool's own
        for lane in (self.light, self.heavy):
            late = [t for t in lane if now >= t.queued_at + self.c.queue_wait_s]
            for t in late:
                lane.remove(t)
                t.finish(Verdict(Outcome.BUSY, "no compile worker became free in time"))
        heapq.heapify(self.light)

    def _overran(self, p: _Proc, now: float) -> None:
        task = p.task
        if not p.ready or (task is not None and p.started_at is None):  # did not start in time
            self.start_failures += 1
            self._kill(p, Verdict(Outcome.UNAVAILABLE, "the compile worker did not start in time"))
        elif task is None:  # idle for idle_s: retired
            self._kill(p, None)
        elif p.heavy or (p.started_at is not None and now - p.started_at >= task.timeout_s):
            self.kills += 1
            self._kill(p, Verdict(Outcome.TIMEOUT))
        else:
            self._light_overran(p, task, now)

    def _light_overran(self, p: _Proc, task: _Task, now: float) -> None:
        """A job past ``light_s`` is heavy: promoted in place if a heavy slot is free (it keeps
        its process and its start time), else killed to start afresh in the heavy lane."""
        self._remember_heavy(task)
        if self._heavy_running() < self.c.heavy_workers:
            p.heavy = True
            return
        p.task = None
        self.kills += 1
        self._kill(p, None)
        task.heavy, task.queued_at = True, now
        self.heavy.append(task)

    def _remember_heavy(self, task: _Task) -> None:
        self.heavy_keys[hash((task.kind, task.spec))] = None
        while len(self.heavy_keys) > _HEAVY_KEYS:
            self.heavy_keys.popitem(last=False)

    # -- dispatch ----------------------------------------------------------------------------

    def _heavy_running(self) -> int:
        return sum(1 for p in self.procs if p.task is not None and p.heavy)

    def _idle(self) -> _Proc | None:
        return next((p for p in self.procs if p.ready and p.task is None), None)

    def _dispatch(self, now: float) -> None:
        while self.heavy and self._heavy_running() < self.c.heavy_workers and (p := self._idle()):
            self._assign(p, self.heavy.popleft(), heavy=True, now=now)
        while self.light and (p := self._idle()):
            self._assign(p, heapq.heappop(self.light), heavy=False, now=now)
        self._start_workers(now)

    def _start_workers(self, now: float) -> None:
        """One process per job that could start now, plus a warm spare while the pool is in use
        (a killed worker's replacement is then ready at once), up to light + heavy + 1."""
        waiting = len(self.light) + min(len(self.heavy), self.c.heavy_workers - self._heavy_running())
        spare = 1 if now - self.last_submit < self.c.idle_s else 0
        free = sum(1 for p in self.procs if not p.ready or p.task is None)
        cap = self.c.light_workers + self.c.heavy_workers + 1
        while free < waiting + spare and len(self.procs) < cap and self.start_failures < _START_FAILURES:
            self._spawn(now)
            free += 1
        if self.start_failures >= _START_FAILURES:  # fail what waits; the next job tries again
            self._fail_queued(Verdict(Outcome.UNAVAILABLE, "the compile worker process does not start"))
            self.start_failures = 0

    def _fail_queued(self, verdict: Verdict) -> None:
        for t in [*self.light, *self.heavy]:
            t.finish(verdict)
        self.light.clear()
        self.heavy.clear()

    def _assign(self, p: _Proc, task: _Task, *, heavy: bool, now: float) -> None:
        p.task, p.heavy, p.started_at, p.since = task, heavy, None, now
        self.jobs += 1
        job: dict[str, Any] = {
            "id": task.seq,
            "kind": task.kind,
            "spec": task.spec,
            "info_key": task.info.key,
            "cpu_s": task.timeout_s + _FUSE_S,
        }
        if task.info.key not in p.infos:  # mirrors the worker's own LRU of tokenizers
            job["info"] = task.info.json
            p.infos[task.info.key] = None
            while len(p.infos) > INFOS_KEPT:
                p.infos.popitem(last=False)
        p.infos.move_to_end(task.info.key)
        try:
            assert p.popen.stdin is not None
            p.popen.stdin.write(json.dumps(job).encode("ascii") + b"\n")
            p.popen.stdin.flush()
        except OSError:  # the worker died while idle: the task waits for another
            p.task = None
            self._died(p)
            self._enqueue(task)

    # -- processes ---------------------------------------------------------------------------

    def _spawn(self, now: float) -> None:
        args = [
            sys.executable,
            "-I",
            str(WORKER_SCRIPT),
            str(os.getpid()),
            json.dumps(sys.path),
            str(self.c.memory_bytes),
            self.mode,
        ]
        env = dict(os.environ, MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1")
        try:
            popen = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError:
            logger.exception("cannot start a grammar compile worker")
            self.start_failures += 1
            return
        p = _Proc(popen, now)
        self.procs.append(p)
        self.sel.register(p.fd, selectors.EVENT_READ, p)

    def _read(self, p: _Proc) -> None:
        try:
            data = os.read(p.fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            self._died(p)
            return
        p.buf += data
        while b"\n" in p.buf and p in self.procs:
            line, p.buf = p.buf.split(b"\n", 1)
            self._message(p, json.loads(line))

    def _message(self, p: _Proc, msg: dict[str, Any]) -> None:
        now = time.monotonic()
        if "hello" in msg:
            p.ready, p.since, self.start_failures = True, now, 0
            return
        task = p.task
        if task is None or msg.get("id") != task.seq:
            return
        if msg.get("started"):
            p.started_at = now
            return
        p.task, p.heavy, p.since = None, False, now
        if msg.get("ok"):
            task.finish(Verdict(Outcome.OK))
        elif msg.get("error") == "memory":
            self._reap(p, kill=True)  # it exits after a memory error anyway: never give it another job
            task.finish(Verdict(Outcome.MEMORY, str(msg.get("message", ""))))
        else:
            task.finish(Verdict(Outcome.INVALID, str(msg.get("message", ""))))

    def _died(self, p: _Proc) -> None:
        """A worker exited on its own (or its pipe broke)."""
        task, ready = p.task, p.ready
        self._reap(p, kill=True)
        code = p.popen.returncode
        if not ready:
            self.start_failures += 1
            if self.mode == "lean":
                logger.warning("grammar compile worker exited (%s) before starting; using full imports", code)
                self.mode = "full"
        if task is None:
            return
        if p.started_at is None and not task.requeued:  # not its fault (yet): once more, elsewhere
            task.requeued = True
            self._enqueue(task)
        elif p.started_at is None:
            task.finish(Verdict(Outcome.UNAVAILABLE, f"the compile worker exited ({code}) before compiling"))
        else:
            how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            task.finish(Verdict(Outcome.CRASHED, f"the compiler process died: {how}"))

    def _kill(self, p: _Proc, verdict: Verdict | None) -> None:
        task = p.task
        self._reap(p, kill=True)
        if task is not None and verdict is not None:
            task.finish(verdict)

    def _reap(self, p: _Proc, *, kill: bool) -> None:
        if p not in self.procs:
            return
        self.procs.remove(p)
        self.sel.unregister(p.fd)
        if kill and p.popen.poll() is None:
            p.popen.kill()
        for pipe in (p.popen.stdin, p.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            p.popen.wait(10.0)  # SIGKILLed: gone at once, unless the kernel is very busy
        except subprocess.TimeoutExpired:
            logger.warning("grammar compile worker %d did not exit after SIGKILL", p.popen.pid)


_SHARED: tuple[int, GrammarPool] | None = None
_SHARED_LOCK = threading.Lock()


def shared_pool() -> GrammarPool:
    """The process's pool (one per process id: a forked child gets its own), started lazily."""
    global _SHARED  # noqa: PLW0603 - the process's one pool, made lazily under _SHARED_LOCK
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED[0] != os.getpid():
            pool = GrammarPool()
            atexit.register(pool.shutdown)
            _SHARED = (os.getpid(), pool)
        return _SHARED[1]

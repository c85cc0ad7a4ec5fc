"""AsyncEngine: many concurrent streams sharing one engine loop.

The engine steps back to back in one dedicated thread (torch releases the GIL), and hands each
step's outputs to the event loop with ``call_soon_threadsafe``: streaming the outputs of step t
overlaps with computing step t+1, so the event loop never stalls the batch. Requests and aborts
go through the engine's inbox. A consumer that stops iterating aborts its request; it leaves
the batch at the next step.

A consumer that falls behind does not make its stream buffer without bound: once
``EngineConfig.stream_buffer_outputs`` outputs wait undelivered, its request is paused (out of
the batch, KV kept; the other requests go on) and it resumes when half of them are taken.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from worker.config import EngineConfig
from worker.engine import LLMEngine, Prompt
from worker.kv import CachedBlocks
from worker.model.host_threads import on_own_thread
from worker.model.loader import LoadedModel
from worker.outputs import OutputAccumulator, RequestOutput
from worker.request import Scheduling
from worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps between checks for work (it is woken at once on new work).
_IDLE_WAIT_S = 0.5


# The engine loop counts as stalled when it has not come round for this long while it has work.
STALL_TIMEOUT_S = 60.0
# How long a caller of `cached_blocks` waits for the engine thread to come round (one step).
CACHED_BLOCKS_TIMEOUT_S = 5.0


@dataclass
class _Stream:
    """One request's outputs on their way to its consumer (event-loop side only)."""

    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    undelivered: int = 0
    paused: bool = False


class OutputStreams:
    """The open requests' output streams, on the event loop, with the consumer-side bound (module
    docstring): one implementation for AsyncEngine and the engine process's client. ``pause`` /
    ``resume`` take a request out of the batch and back (a call into the engine, or a command to
    its process); ``abort`` ends a request whose consumer left before its last output."""

    def __init__(
        self,
        limit: int,
        pause: Callable[[str], None],
        resume: Callable[[str], None],
        abort: Callable[[str], None],
    ) -> None:
        self._limit = limit
        self._pause, self._resume, self._abort = pause, resume, abort
        self._open: dict[str, _Stream] = {}

    def open(self, request_id: str) -> None:
        if request_id in self._open:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self._open[request_id] = _Stream()

    def close(self, request_id: str) -> None:
        """Forget a stream opened but never read (its request never reached the engine)."""
        self._open.pop(request_id, None)

    async def outputs(self, request_id: str, *, delta: bool) -> AsyncGenerator[RequestOutput, None]:
        """The opened request's outputs up to its last, cumulative unless ``delta``; the stream
        closes when this generator does (close it explicitly: ``contextlib.aclosing``)."""
        stream = self._open[request_id]
        acc = OutputAccumulator()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                self._taken(request_id, stream)
                finished = item.finished
                yield item if delta else acc.add(item)
        finally:
            self._open.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    def _taken(self, request_id: str, stream: _Stream) -> None:
        """One output taken by the consumer: a paused request resumes once half the bound is."""
        stream.undelivered -= 1
        if stream.paused and stream.undelivered <= self._limit // 2:
            stream.paused = False
            self._resume(request_id)

    def put(self, out: RequestOutput) -> None:
        """One output to its stream (none: its consumer left); pause a request too far behind."""
        stream = self._open.get(out.request_id)
        if stream is None:
            return
        stream.queue.put_nowait(out)
        stream.undelivered += 1
        if stream.undelivered >= self._limit and not stream.paused and not out.finished:
            stream.paused = True
            self._pause(out.request_id)

    def fail(self, request_id: str, exc: BaseException) -> None:
        """Raise ``exc`` in the request's consumer (after what it has not taken yet)."""
        stream = self._open.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(exc)

    def fail_all(self, exc: BaseException) -> None:
        for stream in self._open.values():
            stream.queue.put_nowait(exc)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served by this engine."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for health checks and metrics (read from any thread)."""

    alive: bool
    heartbeat_age_s: float  # seconds since the engine loop last came round
    num_running: int
    num_waiting: int
    # Terminal outcomes of sequences so far, by finish reason (stop, length, abort, error).
    finished: dict[str, int] = field(default_factory=dict)
    restarts: int = 0  # times the batch state was rebuilt after a failure
    kv: dict[str, float] = field(default_factory=dict)  # LLMEngine.kv_stats() where available
    # The user request id of every row of the persistent batch after the last step, in row order.
    batch_request_ids: tuple[str, ...] = ()
    # Sequences out of the batch because their stream's consumer is behind.
    num_paused: int = 0


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, loaded: LoadedModel | None = None) -> None:
        # Built on a thread that ends, so the engine thread is the only one keeping OpenMP
        # workers (worker.model.host_threads: an idle second team slows every CPU step).
        self.engine = on_own_thread(LLMEngine, config, loaded=loaded)
        self._streams = OutputStreams(
            config.stream_buffer_outputs, self.engine.pause_request, self._resume, self._abort_request
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._work = threading.Event()
        self._stopping = False
        self.dead: BaseException | None = None
        self.heartbeat = time.monotonic()
        # Engine state is owned by the engine thread; other threads read this copy, which the
        # engine thread replaces (one reference assignment) after every step.
        self._published = self._snapshot_engine()
        # Callers of cached_blocks waiting for the engine thread (appended here, served there).
        self._cache_waiters: collections.deque[asyncio.Future[CachedBlocks]] = collections.deque()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's size (this rank's, in a tensor-parallel group)."""
        return self.engine.runner.kv_cache_bytes

    @property
    def processor_fqcns(self) -> tuple[str, ...]:
        """The loaded logits processors, by FQCN, in the order they run."""
        return tuple(p.fqcn for p in self.engine.processors.describe())

    def rank_pids(self) -> list[int]:
        """A tensor-parallel group's other ranks' processes (none in one process)."""
        return self.engine.runner.rank_pids()

    def healthy(self, stall_timeout_s: float = STALL_TIMEOUT_S) -> bool:
        """True while the loop is alive and came round recently (a heartbeat, not "the object exists")."""
        if self.dead is not None or not self.engine.runner.healthy():  # a tensor-parallel group: every rank up
            return False
        if self._thread is None:
            return not self._stopping  # not started yet: started on the first request
        return self._thread.is_alive() and time.monotonic() - self.heartbeat < stall_timeout_s

    def stats(self) -> EngineStats:
        """Liveness now, engine counters as of the last step (safe to call from any thread)."""
        return replace(
            self._published,
            alive=self.healthy(),
            heartbeat_age_s=time.monotonic() - self.heartbeat if self._thread is not None else 0.0,
        )

    def _snapshot_engine(self) -> EngineStats:
        """Read the engine's counters; only on the engine thread (or before it starts)."""
        eng = self.engine
        return EngineStats(
            alive=True,
            heartbeat_age_s=0.0,
            num_running=eng.num_running,
            num_waiting=eng.num_waiting,
            finished=dict(eng.finish_counts),
            restarts=eng.num_restarts,
            kv=dict(eng.kv_stats()),
            batch_request_ids=tuple(eng.batch_request_ids()),
            num_paused=eng.num_paused,
        )

    async def cached_blocks(self, timeout_s: float = CACHED_BLOCKS_TIMEOUT_S) -> CachedBlocks:
        """What the prefix cache holds (cluster.routing publishes it): copied on the engine
        thread between two steps, since the pool is that thread's; before the thread starts,
        here. TimeoutError when the loop does not come round within ``timeout_s``."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self.dead!r}")
        if self._thread is None:
            return self.engine.kv.pool.cached()
        fut: asyncio.Future[CachedBlocks] = asyncio.get_running_loop().create_future()
        self._cache_waiters.append(fut)
        self._work.set()
        return await asyncio.wait_for(fut, timeout_s)

    def _serve_cache_waiters(self) -> None:
        """On the engine thread: one copy of the cache for everyone waiting for one."""
        if not self._cache_waiters:
            return
        cached = self.engine.kv.pool.cached()
        while self._cache_waiters:
            fut = self._cache_waiters.popleft()
            fut.get_loop().call_soon_threadsafe(_resolve, fut, cached)  # each on its own loop

    def validate(self, params: SamplingParams) -> SamplingParams:
        return self.engine.validate(params)

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        delta: bool = False,
        scheduling: Scheduling | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request: cumulative by default, or per-step deltas.

        ``scheduling``: its group, tenant and priority for fair admission. Raises ValueError
        before admission when the request is invalid.
        """
        if self.dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self.dead!r}")
        self._streams.open(request_id)  # ValueError when the id is already running
        try:
            if params.structured_outputs is None:
                parent = self.engine.prepare(request_id, prompt, params, scheduling)
            else:  # compiling a grammar (time-bounded, cached) must not hold up the event loop
                parent = await asyncio.to_thread(self.engine.prepare, request_id, prompt, params, scheduling)
        except BaseException:
            self._streams.close(request_id)
            raise
        self._ensure_thread()
        self.engine.add_prepared(parent)
        self._work.set()
        async with contextlib.aclosing(self._streams.outputs(request_id, delta=delta)) as outputs:
            async for out in outputs:
                yield out

    def _resume(self, request_id: str) -> None:
        self.engine.resume_request(request_id)
        self._work.set()

    def _abort_request(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._work.set()

    async def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._work.set()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="logitpool-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        while not self._stopping:
            self.heartbeat = time.monotonic()
            self._serve_cache_waiters()
            if not self.engine.has_work():  # nothing, or only paused requests
                self._work.wait(_IDLE_WAIT_S)
                self._work.clear()
                continue
            try:
                outputs = self.engine.step()
                if not self.engine.runner.healthy():  # a tensor-parallel rank is gone: no later step can run
                    raise RuntimeError("model runner unhealthy: a tensor-parallel rank exited or a collective failed")
            except Exception as exc:  # an engine bug: fail everyone loudly rather than hang
                logger.exception("engine step failed")
                self.dead = exc
                loop.call_soon_threadsafe(self._fail_all, exc)
                return
            self._published = self._snapshot_engine()
            if outputs:
                loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams (OutputStreams.put pauses one too far behind)."""
        for out in outputs:
            self._streams.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        self._streams.fail_all(EngineDeadError(f"engine step failed: {exc!r}"))

    async def shutdown(self) -> None:
        self._stopping = True
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        self.engine.close()  # a tensor-parallel group's ranks exit with it


__all__ = ["AsyncEngine", "EngineDeadError", "EngineStats", "OutputStreams"]


def _resolve(fut: asyncio.Future[CachedBlocks], cached: CachedBlocks) -> None:
    if not fut.done():  # its caller may have timed out
        fut.set_result(cached)

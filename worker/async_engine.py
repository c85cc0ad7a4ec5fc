"""AsyncEngine: many concurrent streams sharing one engine loop.

The engine steps back to back in one dedicated thread (torch releases the GIL), and hands each
step's outputs to the event loop with ``call_soon_threadsafe``: streaming the outputs of step t
overlaps with computing step t+1, so the event loop never stalls the batch. Requests and aborts
go through the engine's inbox. A consumer that stops iterating aborts its request; it leaves
the batch at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from worker.config import EngineConfig
from worker.engine import LLMEngine, Prompt
from worker.models import LoadedModel
from worker.outputs import OutputAccumulator, RequestOutput
from worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps between checks for work (it is woken at once on new work).
_IDLE_WAIT_S = 0.5


# The engine loop counts as stalled when it has not come round for this long while it has work.
STALL_TIMEOUT_S = 60.0


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


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, loaded: LoadedModel | None = None) -> None:
        self.engine = LLMEngine(config, loaded=loaded)
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._work = threading.Event()
        self._stopping = False
        self.dead: BaseException | None = None
        self.heartbeat = time.monotonic()
        # Engine state is owned by the engine thread; other threads read this copy, which the
        # engine thread replaces (one reference assignment) after every step.
        self._published = self._snapshot_engine()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def healthy(self, stall_timeout_s: float = STALL_TIMEOUT_S) -> bool:
        """True while the loop is alive and came round recently (a heartbeat, not "the object exists")."""
        if self.dead is not None:
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
        )

    def validate(self, params: SamplingParams) -> None:
        self.engine.validate(params)

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams, *, delta: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request: cumulative by default, or per-step deltas.

        Raises ValueError before admission when the request is invalid.
        """
        if self.dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self.dead!r}")
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already running")
        if params.structured_outputs is None:
            parent = self.engine.prepare(request_id, prompt, params)
        else:  # compiling a grammar (time-bounded, cached) must not hold up the event loop
            parent = await asyncio.to_thread(self.engine.prepare, request_id, prompt, params)
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = q
        self._ensure_thread()
        self.engine.add_prepared(parent)
        self._work.set()
        acc = OutputAccumulator()
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item if delta else acc.add(item)
        finally:
            self._queues.pop(request_id, None)
            if not finished:
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
            if not self.engine.has_unfinished():
                self._work.wait(_IDLE_WAIT_S)
                self._work.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # an engine bug: fail everyone loudly rather than hang
                logger.exception("engine step failed")
                self.dead = exc
                loop.call_soon_threadsafe(self._fail_all, exc)
                return
            self._published = self._snapshot_engine()
            if outputs:
                loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(f"engine step failed: {exc!r}"))

    async def shutdown(self) -> None:
        self._stopping = True
        self._work.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None


__all__ = ["AsyncEngine", "EngineDeadError", "EngineStats"]

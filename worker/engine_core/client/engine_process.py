"""EngineProcess: a served replica's engine, its step loop in a child process (the core).

The replica's event loop, Ray's per-message work and the stream merging then share no GIL with
the engine's steps. One reader thread takes every event off the pipe and hands it to the event
loop (call_soon_threadsafe); commands are sent from the loop. It is AsyncEngine's surface for
`cluster.worker_deployment.ServedEngine`, with AsyncEngine's semantics:

- a consumer that falls `stream_buffer_outputs` outputs behind pauses its request (a Pause
  command: the consumer is here), and it resumes once half of them are taken;
- a consumer that stops iterating (or is cancelled) aborts its request;
- an invalid request raises ValueError before any output (the core answers the add with
  Rejected ahead of anything else about that request: the order the pipe keeps);
- the core dying (killed, segfault, OOM) is EOF here: `dead` is set, every open stream raises
  EngineDeadError, healthy() turns False; the core exits when this process dies.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from worker.async_engine import CACHED_BLOCKS_TIMEOUT_S, STALL_TIMEOUT_S, EngineDeadError, EngineStats, OutputStreams
from worker.config import EngineConfig
from worker.engine import Prompt
from worker.engine_core.client.spawn import START_TIMEOUT_S, start_core, wait_ready
from worker.engine_core.protocol import (
    Abort,
    AddRequest,
    CachedBlocksReply,
    Command,
    EngineFailed,
    Event,
    Heartbeat,
    Pause,
    QueryCachedBlocks,
    Rejected,
    Resume,
    Shutdown,
    StepOutputs,
)
from worker.kv import CachedBlocks
from worker.outputs import RequestOutput
from worker.request import Scheduling
from worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_A = TypeVar("_A")


# How long shutdown waits for the core to exit by itself before it is killed.
SHUTDOWN_TIMEOUT_S = 60.0
# How long kill() waits for the killed core to be reaped.
KILL_WAIT_S = 10.0


class EngineProcess:
    """The engine of a served replica, in its own process. Used from one event loop at a time."""

    def __init__(self, config: EngineConfig, *, num_threads: int = 1, start_timeout_s: float = START_TIMEOUT_S) -> None:
        """Starts the core and waits (at most ``start_timeout_s``) for its engine to be built;
        ``num_threads``: torch's threads in the core (the CPUs the replica was given)."""
        self.config = config
        self.dead: BaseException | None = None
        self._proc, self._conn = start_core(config, num_threads)
        try:
            ready = wait_ready(self._proc, self._conn, start_timeout_s)
        except BaseException:
            self._reap(kill=True)
            raise
        self.pid = ready.pid
        self.num_threads = ready.num_threads
        self.ray_imported = ready.ray_imported
        self._kv_cache_bytes = ready.kv_cache_bytes
        self._processor_fqcns = ready.processor_fqcns
        self._rank_pids = list(ready.rank_pids)
        self._streams = OutputStreams(
            config.stream_buffer_outputs, self._pause, lambda rid: self._send(Resume(rid)), self._abort_request
        )
        # A request's prompt, from its first output (later ones come without it), until it ends.
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}
        self._cache_waiters: dict[int, asyncio.Future[CachedBlocks]] = {}
        self._query_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send_lock = threading.Lock()
        now = time.monotonic()
        self._stats = EngineStats(alive=True, heartbeat_age_s=0.0, num_running=0, num_waiting=0)
        self._stats_at = now  # when the last event came (any event says the core's loop is alive)
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="logitpool-engine-reader", daemon=True)
        self._reader.start()
        atexit.register(self.close)  # before multiprocessing joins its non-daemon children

    # -- what the replica reads ---------------------------------------------------------------

    @property
    def kv_cache_bytes(self) -> int:
        return self._kv_cache_bytes

    @property
    def processor_fqcns(self) -> tuple[str, ...]:
        return self._processor_fqcns

    def rank_pids(self) -> list[int]:
        return list(self._rank_pids)

    @property
    def num_running(self) -> int:
        return self._stats.num_running

    def healthy(self, stall_timeout_s: float = STALL_TIMEOUT_S) -> bool:
        """The core is alive, its loop spoke recently, and its engine loop is healthy (it says)."""
        if self.dead is not None or self._closed or not self._proc.is_alive():
            return False
        return self._stats.alive and time.monotonic() - self._stats_at < stall_timeout_s

    def stats(self) -> EngineStats:
        """The core's last snapshot, liveness as of now (any thread)."""
        stats, at = self._stats, self._stats_at
        return dataclasses.replace(
            stats, alive=self.healthy(), heartbeat_age_s=stats.heartbeat_age_s + time.monotonic() - at
        )

    # -- requests --------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        delta: bool = False,
        scheduling: Scheduling | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (cumulative, or per-step deltas): AsyncEngine.generate.

        Raises ValueError before any output when the engine refuses the request.
        """
        self._check_alive()
        self._bind_loop()
        self._streams.open(request_id)  # ValueError when the id is already running
        try:
            self._send(AddRequest(request_id, prompt, params, scheduling))
        except BaseException:
            self._streams.close(request_id)
            raise
        try:
            async with contextlib.aclosing(self._streams.outputs(request_id, delta=delta)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self._prompts.pop(request_id, None)

    def _pause(self, request_id: str) -> None:
        with contextlib.suppress(EngineDeadError):  # then the streams fail anyway
            self._send(Pause(request_id))

    def _abort_request(self, request_id: str) -> None:
        if self.dead is None:
            with contextlib.suppress(EngineDeadError):
                self._send(Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    async def cached_blocks(self, timeout_s: float = CACHED_BLOCKS_TIMEOUT_S) -> CachedBlocks:
        """What the core's prefix cache holds; TimeoutError when it does not answer in ``timeout_s``."""
        self._check_alive()
        self._bind_loop()
        qid = next(self._query_ids)
        fut: asyncio.Future[CachedBlocks] = asyncio.get_running_loop().create_future()
        self._cache_waiters[qid] = fut
        try:
            self._send(QueryCachedBlocks(qid))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._cache_waiters.pop(qid, None)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self.dead!r}")
        if self._closed:
            raise EngineDeadError("engine process closed")

    def _bind_loop(self) -> None:
        self._loop = asyncio.get_running_loop()

    def _send(self, cmd: Command) -> None:
        try:
            with self._send_lock:
                self._conn.send(cmd)
        except (OSError, ValueError) as exc:  # the core is gone (or the pipe closed)
            raise EngineDeadError(f"engine core unreachable: {exc!r}") from exc

    # -- events (reader thread -> event loop) --------------------------------------------------

    def _read(self) -> None:
        """The reader thread: stats are taken here, the rest goes to the event loop in order."""
        try:
            while True:
                event: Event = self._conn.recv()
                if isinstance(event, (StepOutputs, Heartbeat)):
                    self._stats, self._stats_at = event.stats, time.monotonic()
                    if isinstance(event, Heartbeat):
                        continue
                else:
                    self._stats_at = time.monotonic()
                self._call(self._on_event, event)
        except (EOFError, OSError):
            pass
        # EOF: the core exited (told to, or killed); nothing more comes, so nobody may wait on it.
        self._proc.join(KILL_WAIT_S)  # reap it (its exit code names the failure)
        if self._closed:
            err = EngineDeadError("engine process closed")
        else:
            err = EngineDeadError(f"engine core process exited (exit code {self._proc.exitcode})")
            logger.error("%s", err)
        if self.dead is None:
            self.dead = err
        self._call(self._fail_all, err)

    def _call(self, fn: Callable[[_A], None], arg: _A) -> None:
        loop = self._loop
        if loop is None:  # no request yet: nobody waits on an event
            return
        with contextlib.suppress(RuntimeError):  # that loop is closed: its waiters are gone
            loop.call_soon_threadsafe(fn, arg)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, StepOutputs):
            self._dispatch(event.outputs)
        elif isinstance(event, Rejected):
            self._streams.fail(event.request_id, _rejection(event))
        elif isinstance(event, CachedBlocksReply):
            fut = self._cache_waiters.get(event.query_id)
            if fut is not None and not fut.done():
                if event.blocks is None:
                    fut.set_exception(EngineDeadError(event.error))
                else:
                    fut.set_result(event.blocks)
        elif isinstance(event, EngineFailed):
            err = EngineDeadError(event.error)
            if self.dead is None:
                self.dead = err
            self._fail_all(err)

    def _dispatch(self, outputs: tuple[RequestOutput, ...]) -> None:
        """A step's outputs to their streams, each with its prompt (OutputStreams.put pauses a
        request whose consumer is too far behind)."""
        for out in outputs:
            if out.request_id not in self._prompts:
                self._prompts[out.request_id] = (out.prompt, out.prompt_token_ids)
            else:
                out.prompt, out.prompt_token_ids = self._prompts[out.request_id]
            self._streams.put(out)

    def _fail_all(self, exc: EngineDeadError) -> None:
        self._streams.fail_all(EngineDeadError(str(exc)))
        for fut in self._cache_waiters.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(str(exc)))

    # -- lifetime ------------------------------------------------------------------------------

    def kill(self) -> None:
        """SIGKILL the core, as a real failure would (test hooks): returns once it is reaped and
        `dead` is set, so what the replica reports next says dead."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self._proc.join(KILL_WAIT_S)
        if self.dead is None:
            self.dead = EngineDeadError(f"engine core process killed (exit code {self._proc.exitcode})")

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Ask the core to stop (it closes its engine and ranks), kill it past the bound; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        with contextlib.suppress(OSError, ValueError), self._send_lock:
            self._conn.send(Shutdown())
        self._reap(kill=False)

    def _reap(self, *, kill: bool) -> None:
        if not kill:
            self._proc.join(SHUTDOWN_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(KILL_WAIT_S)
        with contextlib.suppress(OSError):
            self._conn.close()


def _rejection(event: Rejected) -> Exception:
    """What a refused add raises in the caller: bad input stays ValueError."""
    if event.error_type == "ValueError":
        return ValueError(event.message)
    if event.error_type == "EngineDeadError":
        return EngineDeadError(event.message)
    return RuntimeError(f"{event.error_type}: {event.message}")


__all__ = ["EngineDeadError", "EngineProcess"]

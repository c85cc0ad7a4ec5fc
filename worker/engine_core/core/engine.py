"""CoreEngine: AsyncEngine's step loop with the parent process as the consumer of every stream.

The step thread, the inbox and the failure handling are AsyncEngine's own; what differs is where
a step's outputs go (one `StepOutputs` message for all requests, not per-stream queues) and where
requests come from (commands). Backpressure is the parent's: it sees its consumers and sends
Pause/Resume. Everything here runs on the core's event loop thread, the one that sends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.engine_core.protocol import (
    Abort,
    AddRequest,
    CachedBlocksReply,
    Command,
    EngineFailed,
    Event,
    Pause,
    QueryCachedBlocks,
    Rejected,
    Resume,
    Shutdown,
    StepOutputs,
)
from worker.outputs import RequestOutput

logger = logging.getLogger(__name__)


class CoreEngine(AsyncEngine):
    def __init__(self, config: EngineConfig, send: Callable[[Event], None], on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._send = send
        self._on_shutdown = on_shutdown
        self._prompt_sent: set[str] = set()  # requests whose first output (with the prompt) went out
        self._preparing: set[str] = set()  # structured requests compiling their grammar off the loop
        self._aborted_early: set[str] = set()  # aborted while preparing: never admitted
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Start the step thread now (on the running loop), not at the first request."""
        self._ensure_thread()

    def handle(self, cmd: Command) -> None:
        """One command from the parent, in the order sent."""
        if isinstance(cmd, AddRequest):
            self._add(cmd)
        elif isinstance(cmd, Abort):
            if cmd.request_id in self._preparing:
                self._aborted_early.add(cmd.request_id)
            self._prompt_sent.discard(cmd.request_id)
            self.engine.abort_request(cmd.request_id)
            self._work.set()
        elif isinstance(cmd, Pause):
            self.engine.pause_request(cmd.request_id)
        elif isinstance(cmd, Resume):
            self.engine.resume_request(cmd.request_id)
            self._work.set()
        elif isinstance(cmd, QueryCachedBlocks):
            self._spawn(self._reply_cached(cmd.query_id))
        elif isinstance(cmd, Shutdown):
            self._on_shutdown()
        else:  # a parent of another version: say so rather than drop it silently
            logger.error("unknown command %r", cmd)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _add(self, cmd: AddRequest) -> None:
        if self.dead is not None:
            self._send(Rejected(cmd.request_id, "EngineDeadError", f"engine loop stopped: {self.dead!r}"))
            return
        if cmd.params.structured_outputs is None:
            try:
                parent = self.engine.prepare(cmd.request_id, cmd.prompt, cmd.params, cmd.scheduling)
            except Exception as exc:  # noqa: BLE001 - answered to the caller, which raises it
                self._send(Rejected(cmd.request_id, type(exc).__name__, str(exc)))
                return
            self.engine.add_prepared(parent)
            self._work.set()
        else:  # compiling a grammar (time-bounded, cached) must not hold up the loop
            self._preparing.add(cmd.request_id)
            self._spawn(self._add_structured(cmd))

    async def _add_structured(self, cmd: AddRequest) -> None:
        try:
            parent = await asyncio.to_thread(
                self.engine.prepare, cmd.request_id, cmd.prompt, cmd.params, cmd.scheduling
            )
        except Exception as exc:  # noqa: BLE001 - answered to the caller, which raises it
            self._send(Rejected(cmd.request_id, type(exc).__name__, str(exc)))
            return
        finally:
            self._preparing.discard(cmd.request_id)
        if cmd.request_id in self._aborted_early:
            self._aborted_early.discard(cmd.request_id)
            return
        self.engine.add_prepared(parent)
        self._work.set()

    async def _reply_cached(self, query_id: int) -> None:
        try:
            blocks = await self.cached_blocks()
        except Exception as exc:  # noqa: BLE001 - the parent raises it to its caller
            self._send(CachedBlocksReply(query_id, None, repr(exc)))
            return
        self._send(CachedBlocksReply(query_id, blocks))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, all requests in one message; only a request's first carries its prompt."""
        slim = []
        for out in outputs:
            rid = out.request_id
            if rid in self._prompt_sent:
                slim.append(replace(out, prompt=None, prompt_token_ids=[]))
            else:
                self._prompt_sent.add(rid)
                slim.append(out)
            if out.finished:
                self._prompt_sent.discard(rid)
        self._send(StepOutputs(tuple(slim), self.stats()))

    def _fail_all(self, exc: BaseException) -> None:
        self._send(EngineFailed(f"engine step failed: {exc!r}"))

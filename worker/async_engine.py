"""AsyncEngine: many concurrent streams sharing one engine loop.

The engine steps in one dedicated thread (torch releases the GIL), so the event loop stays free
to stream outputs while the model runs. Requests and aborts go through the engine's inbox.
A consumer that stops iterating aborts its request; it leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from worker.config import EngineConfig
from worker.engine import LLMEngine, Prompt
from worker.models import LoadedModel
from worker.outputs import FinishReason, OutputAccumulator, RequestOutput
from worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; no request can be served by this engine."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, loaded: LoadedModel | None = None) -> None:
        self.engine = LLMEngine(config, loaded=loaded)
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitpool-engine")
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def validate(self, params: SamplingParams) -> None:
        self.engine.validate(params)

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams, *, delta: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request: cumulative by default, or per-step deltas.

        Raises ValueError before admission when the request is invalid.
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine loop stopped: {self._dead!r}")
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already running")
        parent = self.engine.prepare(request_id, prompt, params)
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = q
        self.engine.add_prepared(parent)
        self._kick()
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
                self._kick()

    async def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._kick()

    def _kick(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        assert self._wakeup is not None
        self._wakeup.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_unfinished():
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:  # an engine bug: fail everyone loudly rather than hang
                logger.exception("engine step failed")
                self._dead = exc
                for q in self._queues.values():
                    q.put_nowait(EngineDeadError(f"engine step failed: {exc!r}"))
                return
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
            await asyncio.sleep(0)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
            self._loop_task = None
        self._executor.shutdown(wait=True, cancel_futures=True)


__all__ = ["AsyncEngine", "EngineDeadError", "FinishReason"]

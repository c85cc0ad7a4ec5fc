"""A fake engine for the worker deployment (cluster.worker_deployment takes an engine factory): no model,
no torch step, a behaviour chosen per test. Tests run it in Serve's local testing mode, in
this process, so the class attributes below are shared with the test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import ClassVar

from worker.async_engine import EngineDeadError, EngineStats
from worker.config import EngineConfig
from worker.kv import CachedBlocks
from worker.outputs import CompletionOutput, RequestOutput
from worker.sampling_params import SamplingParams


def fake_token(prompt: list[int], i: int) -> int:
    """The i-th generated token: a pure function of the prompt, so a test can predict it."""
    return (prompt[-1] + 1 + i) % 97


class FakeEngine:
    """Generates `fake_token` ids one per step, text `<id>`; `mode` chooses a failure instead."""

    mode: ClassVar[str] = "ok"  # ok | error (finish_reason error) | dead | invalid | stall
    alive: ClassVar[bool] = True
    seen: ClassVar[list[tuple[str, object, SamplingParams]]] = []
    scheduling: ClassVar[list[object]] = []  # the Scheduling each call carried
    queue_time_s: ClassVar[float] = 0.125  # what it reports on a sequence's last output, as the engine does
    cached_tokens: ClassVar[int | None] = None  # what every output says the prefix cache served

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.dead: BaseException | None = None
        self._running = 0

    @property
    def kv_cache_bytes(self) -> int:
        return 0

    @property
    def processor_fqcns(self) -> tuple[str, ...]:
        return ()

    def rank_pids(self) -> list[int]:
        return []

    @property
    def num_running(self) -> int:
        return self._running

    def stats(self) -> EngineStats:
        return EngineStats(alive=type(self).alive, heartbeat_age_s=0.0, num_running=self._running, num_waiting=0)

    def healthy(self) -> bool:
        return type(self).alive

    async def cached_blocks(self) -> CachedBlocks:
        return CachedBlocks((), 0, 0)  # no KV cache

    async def generate(
        self,
        request_id: str,
        prompt: list[int] | str,
        params: SamplingParams,
        *,
        delta: bool = False,
        scheduling: object = None,
    ) -> AsyncIterator[RequestOutput]:
        type(self).seen.append((request_id, prompt, params))
        type(self).scheduling.append(scheduling)
        mode = type(self).mode
        if mode == "dead":
            raise EngineDeadError("fake engine loop stopped")
        if mode == "invalid":
            raise ValueError("temperature: rejected by the fake engine")
        assert isinstance(prompt, list), "the worker receives token ids"
        self._running += 1
        try:
            for i in range(params.max_tokens):
                if mode == "stall":
                    await asyncio.sleep(3600)
                last = i == params.max_tokens - 1
                tok = fake_token(prompt, i)
                reason = "error" if mode == "error" else ("length" if last else None)
                out = CompletionOutput(
                    index=0,
                    text=f"<{tok}>",
                    token_ids=[tok],
                    cumulative_logprob=None,
                    logprobs=None,
                    finish_reason=reason,
                    error="fake processor failed" if mode == "error" else None,
                    queue_time_s=type(self).queue_time_s if reason is not None else None,
                )
                yield RequestOutput(
                    request_id,
                    None,
                    [],
                    [out],
                    finished=last or mode == "error",
                    num_cached_tokens=type(self).cached_tokens,
                )
                if mode == "error":
                    return
                await asyncio.sleep(0)
        finally:
            self._running -= 1

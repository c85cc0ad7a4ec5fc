"""The worker deployment: each replica is a Ray actor owning one engine.

One model, one persistent batch, one processor registry, one sampler per replica; the engine
loop runs in the background and every request streams its per-step deltas back to the ingress.
Processors arrive as FQCN strings inside the engine config, at start-up only.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from worker.async_engine import AsyncEngine
from worker.config import EngineConfig
from worker.outputs import OutputAccumulator, RequestOutput
from worker.sampling_params import SamplingParams

# How many received request ids a replica remembers (for operators and tests).
_SEEN_IDS = 10_000
# Streams per stream interval a replica sends before it stretches the interval (see _interval).
_STREAMS_PER_INTERVAL = 16


class LogitpoolWorker:
    def __init__(self, engine: dict[str, Any], stream_interval_s: float = 0.0) -> None:
        self.config = EngineConfig(**engine)
        self.stream_interval_s = stream_interval_s
        self.engine = AsyncEngine(self.config)
        self._seen: collections.deque[str] = collections.deque(maxlen=_SEEN_IDS)
        self._num_requests = 0

    async def generate(
        self, request_id: str, prompt: list[int] | str, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream delta RequestOutputs (without the prompt); cancelling the call aborts the request.

        Every streamed item crosses Ray (and then the proxy) at a CPU cost of its own: after the
        first token, deltas are merged and sent at most every ``_interval()`` (and always when
        the request finishes), so the replica's message rate stays bounded however many
        streams it runs — otherwise more streams mean slower steps, hence less merging.
        """
        self._seen.append(request_id)
        self._num_requests += 1
        window = OutputAccumulator()  # the deltas not sent yet, merged
        last_sent = float("-inf")
        async for out in self.engine.generate(request_id, prompt, params, delta=True):
            merged = window.add(out)
            now = time.monotonic()
            if merged.finished or now - last_sent >= self._interval():
                # The caller has the prompt; don't pickle it into every message.
                yield dataclasses.replace(merged, prompt=None, prompt_token_ids=[])
                window, last_sent = OutputAccumulator(), now

    def _interval(self) -> float:
        """The stream interval, stretched once more than _STREAMS_PER_INTERVAL streams run, so a
        replica sends at most ~_STREAMS_PER_INTERVAL / stream_interval_s messages a second."""
        return self.stream_interval_s * max(1.0, self.engine.num_running / _STREAMS_PER_INTERVAL)

    def received(self) -> list[str]:
        """Request ids this replica was asked to run (most recent last)."""
        return list(self._seen)

    def info(self) -> dict[str, Any]:
        ctx = serve.get_replica_context()
        return {
            "replica_id": ctx.replica_id.unique_id,
            "pid": os.getpid(),
            "num_requests": self._num_requests,
            "num_running": self.engine.num_running,
            "kv_cache_bytes": self.engine.engine.runner.kv_cache_bytes,
            "processors": [p["fqcn"] for p in self.engine.engine.processors.describe()],
        }

    async def check_health(self) -> None:
        if self.engine.dead is not None:
            raise RuntimeError(f"engine loop stopped: {self.engine.dead!r}")


WorkerDeployment = serve.deployment(name="LogitpoolWorker")(LogitpoolWorker)

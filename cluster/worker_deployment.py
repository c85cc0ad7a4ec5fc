"""The worker deployment: each replica is a Ray actor owning one engine.

One model, one persistent batch, one processor registry, one sampler per replica; the engine
loop runs in the background and every request streams its per-step deltas back to the ingress.
Processors arrive as FQCN strings inside the engine config, at start-up only. The engine is
built by an `engine_factory` (`served_engine` in production: the engine loop in a process of its
own, worker.engine_core, or in this one), so the deployment and the front end
can be tested against a fake engine in Serve's local testing mode.

Validation and tokenization happen once, in the front end (cluster.frontend): prompts arrive
here as token ids and params already validated, and a bad request is answered there. The engine
still runs its own checks when it admits a request (`LLMEngine.prepare`: params against the
model and the processors, a range check of the ids, the KV pool's capacity): about 20 us a
request on this box, against hundreds of ms of engine time, and what keeps a replica safe from a
caller that reaches the deployment by another route (any handle in the Ray cluster). A "trusted"
flag to skip them would be settable by that same caller, so there is none.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from ray import serve

from cluster import pool_stats
from cluster.gpu_check import check_gpu
from cluster.replica_bind import bind_replica_grpc_to_node_ip
from cluster.routing.report import Reporter
from worker.async_engine import AsyncEngine, EngineStats
from worker.config import EngineConfig
from worker.engine_core import EngineProcess
from worker.kv import CachedBlocks
from worker.outputs import OutputAccumulator, RequestOutput
from worker.request import Scheduling
from worker.sampling_params import SamplingParams

# Streams per stream interval a replica sends before it stretches the interval (see _interval):
# every message costs CPU in this process, the ingress and the proxy, taken from the engine's
# step on a small box (README, "Served path vs vLLM's server").
_STREAMS_PER_INTERVAL = 4
# Test-only hooks (kill the engine loop) exist only when this is set in the replica's environment.
DEBUG_ENV = "LOGITPOOL_DEBUG_HOOKS"
# A replica whose engine loop died exits this long after noticing (time for the failed requests'
# errors to reach the ingress): routers then see the actor gone and stop sending to it at once,
# and Serve starts a replacement without waiting for three failed health checks.
EXIT_DELAY_S = 0.5

logger = logging.getLogger(__name__)


class ServedEngine(Protocol):
    """What a worker replica needs of its engine (AsyncEngine's surface, or a test's fake)."""

    dead: BaseException | None

    @property
    def kv_cache_bytes(self) -> int: ...

    @property
    def processor_fqcns(self) -> tuple[str, ...]: ...

    def rank_pids(self) -> list[int]: ...

    def generate(
        self,
        request_id: str,
        prompt: list[int] | str,
        params: SamplingParams,
        *,
        delta: bool = False,
        scheduling: Scheduling | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    @property
    def num_running(self) -> int: ...

    def stats(self) -> EngineStats: ...

    def healthy(self) -> bool: ...

    async def cached_blocks(self) -> CachedBlocks: ...


EngineFactory = Callable[[EngineConfig], ServedEngine]


def replica_cpus() -> int:
    """The CPUs Ray gave this replica's actor, rounded, at least 1 (the core's torch threads:
    the defaults use the CPUs a replica is given)."""
    import ray

    if not ray.is_initialized():  # Serve's local testing mode: this process's CPUs
        return max(1, os.cpu_count() or 1)
    resources = ray.get_runtime_context().get_assigned_resources()
    return max(1, round(resources["CPU"])) if "CPU" in resources else 1


def served_engine(config: EngineConfig) -> ServedEngine:
    """The production engine factory: the engine loop in its own process (`engine_process`,
    worker.engine_core) on the replica's CPUs, else in this one (AsyncEngine)."""
    if config.engine_process:
        return EngineProcess(config, num_threads=replica_cpus())
    return AsyncEngine(config)


def replica_engine_config(config: EngineConfig) -> tuple[EngineConfig, bool]:
    """The engine config a replica builds its engine from, and whether the CPU is allowed:
    `device: auto` is the engine's own choice (device None) with the CPU explicitly allowed."""
    if config.device == "auto":
        return dataclasses.replace(config, device=None), True
    return config, False


class LogitpoolWorker:
    def __init__(
        self,
        engine: dict[str, Any],
        stream_interval_s: float = 0.0,
        engine_factory: EngineFactory = served_engine,
        published_blocks: int = 0,
    ) -> None:
        """``published_blocks``: block digests per routing report (routing.max_published_blocks
        under the cache-aware policy); 0 = no reports."""
        bind_replica_grpc_to_node_ip()
        config, allow_cpu = replica_engine_config(EngineConfig(**engine))
        # The GPUs Ray gave this replica decide its device (none: CPU, whatever CUDA it can see).
        self.config = dataclasses.replace(config, device=check_gpu(allow_cpu, config.device))
        self.stream_interval_s = stream_interval_s
        self.engine: ServedEngine = engine_factory(self.config)
        self._num_requests = 0
        self._publisher: asyncio.Task[None] | None = None
        self._leaving = False
        self._leaving_task: asyncio.Task[None] | None = None
        self._reporter = Reporter(published_blocks, self.config.block_size) if published_blocks else None

    async def generate(
        self, request_id: str, prompt: list[int] | str, params: SamplingParams, scheduling: Scheduling | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream delta RequestOutputs (without the prompt); cancelling the call aborts the request.

        ``scheduling`` (the client request's group, the API key's tenant id, priority) is what the
        engine's fair admission orders by (worker.fairness).

        Every streamed item crosses Ray (and then the proxy) at a CPU cost of its own: after the
        first token, deltas are merged and sent at most every ``_interval()`` (and always when
        the request finishes), so the replica's message rate stays bounded however many
        streams it runs — otherwise more streams mean slower steps, hence less merging. What
        this generator has not taken yet is bounded by the engine (stream_buffer_outputs, then the
        request pauses); Serve takes every item at once and buffers it in the caller.
        """
        self._leave_if_dead()
        self._num_requests += 1
        window = OutputAccumulator()  # the deltas not sent yet, merged
        last_sent = float("-inf")
        async for out in self.engine.generate(request_id, prompt, params, delta=True, scheduling=scheduling):
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

    def info(self) -> dict[str, Any]:
        ctx = serve.get_replica_context()
        return {
            "replica_id": ctx.replica_id.unique_id,
            "pid": os.getpid(),
            "rank_pids": self.engine.rank_pids(),  # a tensor-parallel replica's other ranks
            "engine_pid": self.engine.pid if isinstance(self.engine, EngineProcess) else os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "num_requests": self._num_requests,
            "num_running": self.engine.num_running,
            "kv_cache_bytes": self.engine.kv_cache_bytes,
            "processors": list(self.engine.processor_fqcns),
        }

    def stats(self) -> pool_stats.PoolSnapshot:
        """This replica's engine stats (a PoolSnapshot of AsyncEngine.stats())."""
        return pool_stats.PoolSnapshot.of(self.engine.stats(), kv_cache_bytes=self.engine.kv_cache_bytes)

    async def _publish(self, what: str) -> None:
        """One snapshot to the KV store (bounded by its timeout); a failure is logged, never raised."""
        ctx = serve.get_replica_context()
        await pool_stats.publish_logged(ctx.app_name, ctx.replica_id.unique_id, self.stats, what=what)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's controller calls this every routing.stats_period_s and hands the result to the
        routers of the worker deployment's handles (cluster.routing): this replica's cached blocks
        and load. {} without reports, or when the engine cannot say (its index then goes stale)."""
        if self._reporter is None:
            return {}
        try:
            cached = await self.engine.cached_blocks()
        except Exception as exc:  # noqa: BLE001 - a report is best effort; routing falls back to load
            logger.warning("routing report failed: %r", exc)
            return {}
        stats = self.engine.stats()
        return self._reporter.report(cached, stats.num_running, stats.num_waiting).to_stats()

    async def check_health(self) -> None:
        """Serve calls this every few seconds (serve_config.HEALTH_CHECK_PERIOD_S): unhealthy as soon
        as the engine loop is dead or stalled, so Serve replaces the replica within seconds."""
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.create_task(pool_stats.publish_forever(lambda: self._publish("engine stats")))
        self._leave_if_dead()
        if not self.engine.healthy():  # stalled: Serve replaces the replica after a few failed checks
            raise RuntimeError(f"engine loop not healthy: {self.engine.dead!r}")

    def _leave_if_dead(self) -> None:
        """An engine loop that died is gone for good: end this replica's process shortly."""
        if self.engine.dead is not None and not self._leaving:
            self._leaving = True
            logger.error("engine loop died (%r); this replica exits in %.1fs", self.engine.dead, EXIT_DELAY_S)
            self._leaving_task = asyncio.create_task(self._leave())

    async def _leave(self) -> None:
        """Publish the dead state first (so /health turns 503 at this heartbeat, not when the
        entry goes stale), then exit; the publish is bounded by the KV store's timeout."""
        await self._publish("the dead state")
        await asyncio.sleep(EXIT_DELAY_S)
        os._exit(1)

    def debug_kill_engine(self) -> float:
        """Test-only: make the engine loop die as a real failure would (under engine_process the
        core process is SIGKILLed, and this returns once the replica knows); returns the time.

        Refused unless LOGITPOOL_DEBUG_HOOKS=1 is set for the replica (never in production).
        """
        if os.environ.get(DEBUG_ENV) != "1":
            raise PermissionError("debug hooks are disabled")
        if isinstance(self.engine, EngineProcess):  # a real failure: the core process is SIGKILLed
            self.engine.kill()
            return time.time()
        exc = RuntimeError("killed by debug_kill_engine")
        engine: Any = self.engine  # AsyncEngine's internals
        engine.dead = exc
        engine._stopping = True  # the loop thread exits at its next turn
        engine._work.set()
        engine._fail_all(exc)
        return time.time()


WorkerDeployment = serve.deployment(name="LogitpoolWorker")(LogitpoolWorker)

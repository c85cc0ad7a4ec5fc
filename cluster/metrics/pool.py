"""Gauges and counters over the worker replicas' snapshots (cluster.pool_stats): logitpool's
(sums; per replica where a sum would mean nothing, like a hit rate), and vLLM's (per worker
replica, its id in vLLM's `engine` label: each replica is one engine)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster import pool_stats
from cluster.metrics.catalog import Names
from cluster.pool_stats import PoolSnapshot

VLLM_LABELS = ["model_name", "engine"]


class PoolCollector:
    def __init__(self, pool: Sequence[PoolSnapshot], model_name: str, names: Names) -> None:
        self.pool = pool
        self.model_name = model_name
        self.names = names

    def collect(self) -> Iterator[Metric]:
        yield from self._logitpool()
        if self.names != "logitpool":
            yield from self._vllm()

    def _logitpool(self) -> Iterator[Metric]:
        pool = self.pool
        replicas = GaugeMetricFamily(
            "logitpool_worker_replicas", "Worker replicas reporting, by engine state", labels=["state"]
        )
        alive = pool_stats.num_alive(pool)
        replicas.add_metric(["alive"], alive)
        replicas.add_metric(["dead"], len(pool) - alive)
        yield replicas
        for key, name, doc in (
            ("num_running", "logitpool_running_sequences", "Sequences in the running batches"),
            ("num_waiting", "logitpool_waiting_sequences", "Sequences waiting for admission"),
        ):
            yield GaugeMetricFamily(name, doc, value=sum(getattr(s, key) for s in pool))
        finished = CounterMetricFamily(
            "logitpool_sequences_finished", "Sequences ended in the engines, by terminal outcome", labels=["reason"]
        )
        reasons: dict[str, int] = {}
        for s in pool:
            for reason, count in s.finished.items():
                reasons[reason] = reasons.get(reason, 0) + count
        for reason, count in sorted(reasons.items()):
            finished.add_metric([reason], count)
        yield finished
        yield CounterMetricFamily(
            "logitpool_engine_restarts",
            "Times an engine rebuilt its batch after a failure",
            value=sum(s.restarts for s in pool),
        )
        kv = GaugeMetricFamily("logitpool_kv_cache", "KV cache state per worker replica", labels=["replica", "stat"])
        for s in pool:
            for stat, value in sorted({**s.kv, "bytes": float(s.kv_cache_bytes)}.items()):
                kv.add_metric([s.replica_id, stat], value)
        yield kv
        age = GaugeMetricFamily(
            "logitpool_engine_heartbeat_age_seconds",
            "Seconds since each replica's engine loop last came round",
            labels=["replica"],
        )
        for s in pool:
            age.add_metric([s.replica_id], s.heartbeat_age_s)
        yield age

    def _vllm(self) -> Iterator[Metric]:
        """vLLM's scheduler and cache series, one per worker replica (vLLM's help texts)."""
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=VLLM_LABELS
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=VLLM_LABELS
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=VLLM_LABELS
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels=VLLM_LABELS,
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels=VLLM_LABELS
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels=VLLM_LABELS
        )
        for s in self.pool:
            labels = [self.model_name, s.replica_id]
            running.add_metric(labels, s.num_running)
            waiting.add_metric(labels, s.num_waiting)
            kv = s.kv  # finite counters of the engine's KV manager, absent where it has none
            if kv.keys() >= {"blocks_used", "blocks_total"} and kv["blocks_total"] > 0:
                usage.add_metric(labels, kv["blocks_used"] / kv["blocks_total"])
            counters = ((queries, "prefix_query_tokens"), (hits, "prefix_hit_tokens"), (preemptions, "num_preemptions"))
            for family, key in counters:
                if key in kv:
                    family.add_metric(labels, kv[key])
        yield from (running, waiting, usage, queries, hits, preemptions)

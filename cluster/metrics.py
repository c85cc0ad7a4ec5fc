"""Prometheus metrics served at /metrics: this ingress replica's request counters and routing
decisions (cluster.routing.stats), plus the engine stats of every worker replica of the
application (see cluster.pool_stats; per-replica prefix hit rates are `logitpool_kv_cache`'s
`prefix_hit_rate`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster import pool_stats
from cluster.pool_stats import PoolSnapshot
from cluster.routing.stats import all_counts
from worker.outputs import RequestOutput


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "logitpool_requests",
            "Requests answered, by protocol and status code",
            ["protocol", "status"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "logitpool_requests_rejected",
            "Requests rejected at the ingress (4xx), by protocol and status",
            ["protocol", "status"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "logitpool_generated_tokens", "Output tokens generated", ["protocol"], registry=self.registry
        )

    def request(self, protocol: str, status: int | str, outs: Sequence[RequestOutput] = (), tokens: int = 0) -> None:
        self.requests.labels(protocol, str(status)).inc()
        n = tokens + sum(len(c.token_ids) for o in outs for c in o.outputs)
        if n:
            self.tokens.labels(protocol).inc(n)

    def reject(self, protocol: str, status: int | str) -> None:
        self.rejected.labels(protocol, str(status)).inc()

    def render(self, pool: Sequence[PoolSnapshot] = ()) -> tuple[bytes, str]:
        """This replica's counters and, from `pool` (pool_stats.collect), the workers' stats."""
        registry = CollectorRegistry()
        registry.register(_PoolCollector(pool))
        registry.register(_RoutingCollector())
        return generate_latest(self.registry) + generate_latest(registry), CONTENT_TYPE_LATEST


class _PoolCollector:
    """Gauges and counters over the worker replicas' snapshots (sums; per replica where a sum
    would mean nothing, like a hit rate)."""

    def __init__(self, pool: Sequence[PoolSnapshot]) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
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


class _RoutingCollector:
    """This process's cache-aware routers (none under power_of_two): how each request was routed,
    the blocks each replica's index holds, the reports taken."""

    def collect(self) -> Iterator[Metric]:
        counts = all_counts()
        routed = CounterMetricFamily(
            "logitpool_routing_requests",
            "Requests routed to each worker replica: by cache (its prefix) or by load",
            labels=["deployment", "replica", "by"],
        )
        index = GaugeMetricFamily(
            "logitpool_routing_index_blocks",
            "Blocks the router believes each replica caches: reported by it, or guessed from routing",
            labels=["deployment", "replica", "source"],
        )
        reports = CounterMetricFamily(
            "logitpool_routing_reports", "Replica cache reports taken by the router", labels=["deployment"]
        )
        report_bytes = CounterMetricFamily(
            "logitpool_routing_report_bytes",
            "Bytes of the replica reports received (pickled; Serve re-sends them all with every replica list)",
            labels=["deployment"],
        )
        for c in counts:
            for (replica, by), n in sorted(c.routed.items()):
                routed.add_metric([c.deployment, replica, by], n)
            for replica, size in sorted(c.index.items()):
                index.add_metric([c.deployment, replica, "reported"], size.reported)
                index.add_metric([c.deployment, replica, "guessed"], size.guessed)
            reports.add_metric([c.deployment], c.reports)
            report_bytes.add_metric([c.deployment], c.report_bytes)
        yield from (routed, index, reports, report_bytes)

"""How this ingress replica's cache-aware routers (cluster.routing; none under power_of_two)
routed requests: by cache or by load per worker replica, the blocks each replica's index holds,
the reports taken. Routers live in the process holding the worker handle, so each ingress replica
counts its own, under its `ingress` label, in the registry it publishes (cluster.metrics.shared):
any replica's /metrics shows every replica's routing."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.routing.stats import all_counts


class RoutingCollector:
    def __init__(self, replica: str) -> None:
        self.replica = replica

    def collect(self) -> Iterator[Metric]:
        routed = CounterMetricFamily(
            "logitpool_routing_requests",
            "Requests routed to each worker replica: by cache (its prefix) or by load",
            labels=["deployment", "replica", "by", "ingress"],
        )
        index = GaugeMetricFamily(
            "logitpool_routing_index_blocks",
            "Blocks the router believes each replica caches: reported by it, or guessed from routing",
            labels=["deployment", "replica", "source", "ingress"],
        )
        reports = CounterMetricFamily(
            "logitpool_routing_reports", "Replica cache reports taken by the router", labels=["deployment", "ingress"]
        )
        report_bytes = CounterMetricFamily(
            "logitpool_routing_report_bytes",
            "Bytes of the replica reports received (pickled; Serve re-sends them all with every replica list)",
            labels=["deployment", "ingress"],
        )
        me = self.replica
        for c in all_counts():
            for (replica, by), n in sorted(c.routed.items()):
                routed.add_metric([c.deployment, replica, by, me], n)
            for replica, size in sorted(c.index.items()):
                index.add_metric([c.deployment, replica, "reported", me], size.reported)
                index.add_metric([c.deployment, replica, "guessed", me], size.guessed)
            reports.add_metric([c.deployment, me], c.reports)
            report_bytes.add_metric([c.deployment, me], c.report_bytes)
        yield from (routed, index, reports, report_bytes)

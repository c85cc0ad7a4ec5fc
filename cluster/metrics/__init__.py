"""Prometheus metrics served at /metrics: every ingress replica's request counters and
histograms (cluster.metrics.clock, shared between replicas by cluster.metrics.shared), plus the
engine stats of every worker replica of the application (cluster.metrics.pool) and this
replica's routing decisions (cluster.metrics.routing), under
logitpool's names, vLLM's or both (config `metrics.names`; the table in docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster.metrics.catalog import Names
from cluster.metrics.clock import LABELS, RequestSeries, SequenceClock
from cluster.metrics.pool import PoolCollector
from cluster.metrics.routing import RoutingCollector
from cluster.metrics.shared import IngressSnapshot, families, with_own
from cluster.pool_stats import PoolSnapshot
from worker.outputs import RequestOutput

# The `ingress` label of a front end outside Serve's replicas (Serve's local testing mode, tests).
LOCAL_REPLICA = "local"


class Metrics:
    """One per ingress replica (its `Frontend`): the registry it publishes, and /metrics."""

    def __init__(
        self, *, model_name: str, max_model_len: int, names: Names = "both", replica: str = LOCAL_REPLICA
    ) -> None:
        self.model_name = model_name
        self.names = names
        self.replica = replica
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "logitpool_requests",
            "Requests answered, by protocol and status code",
            ["protocol", "status", "ingress"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "logitpool_requests_rejected",
            "Requests rejected at the ingress (4xx), by protocol and status",
            ["protocol", "status", "ingress"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "logitpool_generated_tokens", "Output tokens generated", ["protocol", "ingress"], registry=self.registry
        )
        self.series = RequestSeries(self.registry, model_name, replica, max_model_len)
        # This process's routers' counters, read at each snapshot: published with the rest.
        self.registry.register(RoutingCollector(replica))

    def request(self, protocol: str, status: int | str, outs: Sequence[RequestOutput] = (), tokens: int = 0) -> None:
        self.requests.labels(protocol, str(status), self.replica).inc()
        n = tokens + sum(len(c.token_ids) for o in outs for c in o.outputs)
        if n:
            self.tokens.labels(protocol, self.replica).inc(n)

    def reject(self, protocol: str, status: int | str) -> None:
        self.rejected.labels(protocol, str(status), self.replica).inc()

    def clock(self, prompt_tokens: int, n: int) -> SequenceClock:
        """Times one dispatched prompt's ``n`` sequences, from now."""
        return SequenceClock(self.series, prompt_tokens, n)

    def snapshot(self) -> IngressSnapshot:
        """This replica's registry, to publish (cluster.metrics.shared)."""
        return IngressSnapshot.of(self.registry)

    def render(self, pool: Sequence[PoolSnapshot] = (), peers: Sequence[IngressSnapshot] = ()) -> tuple[bytes, str]:
        """Every ingress replica's series (``peers``: their published snapshots, this one's live
        registry standing in until it has published) and, from ``pool``, the workers' stats."""
        registry = CollectorRegistry()
        registry.register(_Families(families(with_own(peers, self.snapshot(), self.replica), self.names)))
        registry.register(PoolCollector(pool, self.model_name, self.names))
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _Families:
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self.metrics)


__all__ = ["LABELS", "LOCAL_REPLICA", "IngressSnapshot", "Metrics", "Names", "SequenceClock"]

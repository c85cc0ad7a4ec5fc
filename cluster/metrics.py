"""Prometheus metrics of one ingress replica (served at /metrics)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from worker.outputs import RequestOutput


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "logitpool_requests", "Requests answered, by protocol and status code",
            ["protocol", "status"], registry=self.registry,
        )
        self.tokens = Counter(
            "logitpool_generated_tokens", "Output tokens generated", ["protocol"], registry=self.registry
        )

    def request(self, protocol: str, status: int | str, outs: Sequence[RequestOutput] = (), tokens: int = 0) -> None:
        self.requests.labels(protocol, str(status)).inc()
        n = tokens + sum(len(c.token_ids) for o in outs for c in o.outputs)
        if n:
            self.tokens.labels(protocol).inc(n)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

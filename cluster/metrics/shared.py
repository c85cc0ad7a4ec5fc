"""Every ingress replica's request metrics, served by whichever replica a scrape reaches.

Serve's proxy routes a scrape of /metrics to one ingress replica of its router's choosing, so a
replica that served only its own counters would hand Prometheus a different replica's values
from one scrape to the next (each a counter "reset"). Instead each ingress replica publishes its
registry as an `IngressSnapshot` (the samples, JSON) to the KV store every
`pool_stats.PUBLISH_INTERVAL_S` (cluster.ingress), and /metrics renders the fresh snapshots of all
of them, each series labelled with its replica (`ingress`). Every scrape then returns every
replica's series, each only ever growing, and Prometheus sums them: `sum by (le) (rate(..._bucket[5m]))`.
Each replica's series are served as last published (at most PUBLISH_INTERVAL_S behind), its own
too: were a replica to serve its own live counts, the next scrape, answered by another replica
from the store, could show them lower. A replica that is gone stops publishing; its series end
(a counter's history keeps its rate).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from pydantic import BaseModel, ConfigDict

from cluster.metrics import catalog

KIND = "ingress"  # the pool_stats key kind of ingress replicas' snapshots


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SampleValue(_Frozen):
    name: str
    labels: dict[str, str]
    value: float


class Family(_Frozen):
    name: str
    documentation: str
    type: str
    samples: tuple[SampleValue, ...]


class IngressSnapshot(_Frozen):
    """One ingress replica's registry as published (cluster.pool_stats.publish, kind `ingress`)."""

    families: tuple[Family, ...]
    time: float = 0.0  # wall clock when taken
    replica_id: str = ""  # set by the reader from the KV key

    @classmethod
    def of(cls, registry: CollectorRegistry) -> IngressSnapshot:
        return cls(
            families=tuple(
                Family(
                    name=m.name,
                    documentation=m.documentation,
                    type=m.type,
                    samples=tuple(SampleValue(name=s.name, labels=s.labels, value=s.value) for s in m.samples),
                )
                for m in registry.collect()
            ),
            time=time.time(),
        )

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, raw: str | bytes, replica_id: str = "") -> IngressSnapshot:
        """ValueError (pydantic's) on anything that is not a snapshot: a bad entry is skipped."""
        snap = cls.model_validate_json(raw)
        return snap.model_copy(update={"replica_id": replica_id or snap.replica_id})


def families(snaps: Iterable[IngressSnapshot], names: catalog.Names) -> list[Metric]:
    """The snapshots' families merged by name (one family, every replica's samples), each under
    the names ``names`` selects (cluster.metrics.catalog.shown)."""
    merged: dict[str, Metric] = {}
    for snap in snaps:
        for f in snap.families:
            for name in catalog.shown(f.name, names):
                if name not in merged:
                    merged[name] = Metric(name, f.documentation, f.type)
                for s in f.samples:
                    merged[name].add_sample(name + s.name[len(f.name) :], dict(s.labels), s.value)
    return list(merged.values())


def with_own(peers: Sequence[IngressSnapshot], own: IngressSnapshot, replica_id: str) -> list[IngressSnapshot]:
    """What /metrics renders: the published snapshots, this replica's included; this replica's
    live one only while it has not published yet (or outside Serve, where nothing is)."""
    if any(p.replica_id == replica_id for p in peers):
        return list(peers)
    return [*peers, own]

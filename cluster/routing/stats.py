"""Counters of the routers in this process, for /metrics (cluster.metrics) and the benchmark.

Serve runs a router on its own event loop thread and /metrics renders on the ingress's loop, so
each router's counters sit behind a lock, held only to add or copy.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from cluster.routing.index import IndexSize

By = Literal["cache", "load"]


@dataclass(frozen=True)
class RoutingCounts:
    """A copy of one router's counters."""

    deployment: str
    routed: dict[tuple[str, By], int] = field(default_factory=dict)  # (replica, by) -> requests
    index: dict[str, IndexSize] = field(default_factory=dict)  # replica -> blocks held
    reports: int = 0  # new replica reports taken
    report_bytes: int = 0  # bytes of every report received, re-sent ones included (pickled)


class RouterStats:
    def __init__(self, deployment: str) -> None:
        self.deployment = deployment
        self._lock = threading.Lock()
        self._routed: Counter[tuple[str, By]] = Counter()
        self._index: dict[str, IndexSize] = {}
        self._reports = 0
        self._report_bytes = 0
        _ALL.add(self)

    def routed(self, replica: str, by: By) -> None:
        with self._lock:
            self._routed[(replica, by)] += 1

    def replica_list(self, new_reports: int, report_bytes: int, index: dict[str, IndexSize]) -> None:
        """One replica list from Serve: the reports in it that were new, the bytes of all of them
        (Serve re-sends every report with each list), the index after it."""
        with self._lock:
            self._reports += new_reports
            self._report_bytes += report_bytes
            self._index = dict(index)

    def counts(self) -> RoutingCounts:
        with self._lock:
            routed, index = dict(self._routed), dict(self._index)
            return RoutingCounts(self.deployment, routed, index, self._reports, self._report_bytes)


_ALL: weakref.WeakSet[RouterStats] = weakref.WeakSet()


def all_counts() -> list[RoutingCounts]:
    """Every live router of this process (one per deployment handle's router)."""
    return sorted((s.counts() for s in list(_ALL)), key=lambda c: c.deployment)

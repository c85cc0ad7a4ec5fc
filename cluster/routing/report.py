"""What a worker replica publishes for the routers: a bounded snapshot of its prefix cache's block
digests plus its load, as Serve routing stats (`LogitpoolWorker.record_routing_stats`).

Serve's controller calls that method every `routing.stats_period_s` and hands the dict it
returns to the router of every handle of the deployment. A snapshot rather than add/evict
events: the controller keeps only the latest dict per replica, so an event between two pulls
would be lost, and a lost eviction would stay a wrong guess forever. A snapshot is bounded:
at most `routing.max_published_blocks` digests (8 bytes each), the shallowest first, since a
block is only found through the blocks before it (the worker and the router both walk a
prompt from its first block).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cluster.routing.blocks import DigestMemo
from worker.kv import CachedBlocks

STATS_KEY = "logitpool_routing"  # the key of our report in a replica's routing stats


@dataclass(frozen=True)
class RoutingReport:
    """One replica's published state. ``seq`` grows with every report, so a router tells a
    fresh report from the controller re-sending the last one (a silent replica)."""

    seq: int
    block_size: int
    digests: bytes  # little-endian uint64 digests (cluster.routing.blocks), shallowest first
    num_cached: int  # blocks the replica caches; more than len(digests) // 8 when truncated
    num_free: int  # KV blocks free (a free block may still hold a cached prefix)
    num_blocks: int
    num_running: int
    num_waiting: int

    def digest_set(self) -> set[int]:
        arr = array("Q")
        arr.frombytes(self.digests)
        if sys.byteorder == "big":
            arr.byteswap()
        return set(arr)

    @property
    def num_published(self) -> int:
        return len(self.digests) // 8

    def to_stats(self) -> dict[str, Any]:
        return {STATS_KEY: dataclasses.asdict(self)}

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any] | None) -> RoutingReport | None:
        """The report in a replica's routing stats; None when there is none or it is malformed
        (a replica of another version, a failed pull): that replica is then routed by load."""
        raw = stats[STATS_KEY] if stats and STATS_KEY in stats else None
        if not isinstance(raw, Mapping):
            return None
        try:
            report = cls(**raw)
        except TypeError:
            return None
        ints = [getattr(report, f.name) for f in dataclasses.fields(cls) if f.name != "digests"]
        if not isinstance(report.digests, bytes) or len(report.digests) % 8 or not all(type(i) is int for i in ints):
            return None
        return report


class Reporter:
    """A worker replica's report builder: digests remembered between reports, `seq` counted."""

    def __init__(self, max_blocks: int, block_size: int) -> None:
        self.max_blocks = max_blocks
        self.block_size = block_size
        self._memo = DigestMemo()
        self._seq = itertools.count(1)

    def report(self, cached: CachedBlocks, num_running: int, num_waiting: int) -> RoutingReport:
        entries = self._memo.of(cached.addresses)
        chosen = sorted(entries.values())[: self.max_blocks]  # (depth, digest): shallowest first
        arr = array("Q", (digest for _, digest in chosen))
        if sys.byteorder == "big":
            arr.byteswap()
        return RoutingReport(
            seq=next(self._seq),
            block_size=self.block_size,
            digests=arr.tobytes(),
            num_cached=len(entries),
            num_free=cached.num_free,
            num_blocks=cached.num_blocks,
            num_running=num_running,
            num_waiting=num_waiting,
        )

"""Every worker replica's engine stats, for /health and /metrics of the whole pool.

A Serve handle reaches one replica of the router's choosing, so asking through it says nothing
about the others. Instead each worker replica publishes a small JSON snapshot of its engine
(``AsyncEngine.stats()``) to the Ray cluster's internal KV store every ``PUBLISH_INTERVAL_S``,
under a key per application and replica; the ingress lists the application's keys. A replica
that died stops publishing and its entry goes stale (ignored after ``STALE_AFTER_S``). Every
KV call runs in a thread under a bounded wait: a slow GCS makes stats late, never a hang.

Ingress replicas publish their request metrics the same way, under a key ``kind`` of their own
(cluster.metrics.shared): a scrape of /metrics reaches one ingress replica of Serve's choosing,
which answers for all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from worker.async_engine import EngineStats

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 1.0
STALE_AFTER_S = 5.0
FORGET_AFTER_S = 300.0  # entries of replicas gone this long are deleted by the next reader
KV_TIMEOUT_S = 2.0
_NAMESPACE = "logitpool"
POOL = "pool"  # the key kind of worker replicas' engine stats


def _prefix(app: str, kind: str) -> str:
    return f"{kind}/{app}/"


def _number(value: float) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class PoolSnapshot:
    """One worker replica's engine, as published to the KV store and read by health, metrics and
    `logitpool status`. JSON on the wire (``to_json`` / ``from_json``); a typed value everywhere else."""

    alive: bool
    heartbeat_age_s: float
    num_running: int
    num_waiting: int
    finished: dict[str, int] = field(default_factory=dict)  # terminal outcomes by finish reason
    restarts: int = 0
    kv: dict[str, float] = field(default_factory=dict)  # finite KV / prefix-cache counters only
    kv_cache_bytes: int = 0
    time: float = 0.0  # wall clock when published
    replica_id: str = ""  # set by the reader from the KV key

    @classmethod
    def of(cls, stats: EngineStats, *, kv_cache_bytes: int = 0) -> PoolSnapshot:
        """From an engine's stats, stamped now. Only finite numbers of ``kv`` are kept: whatever an
        engine puts there, publishing (hence health) cannot fail on it."""
        kv = {str(k): _number(v) for k, v in stats.kv.items()}
        return cls(
            alive=bool(stats.alive),
            heartbeat_age_s=float(stats.heartbeat_age_s),
            num_running=int(stats.num_running),
            num_waiting=int(stats.num_waiting),
            finished={str(k): int(v) for k, v in stats.finished.items()},
            restarts=int(stats.restarts),
            kv={k: v for k, v in kv.items() if v is not None},
            kv_cache_bytes=int(kv_cache_bytes),
            time=time.time(),
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), allow_nan=False)

    @classmethod
    def from_json(cls, raw: str | bytes, replica_id: str = "") -> PoolSnapshot:
        """ValueError (or TypeError) on anything that is not a snapshot: a bad entry is skipped."""
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("pool snapshot: not an object")
        known = {f.name for f in dataclasses.fields(cls)}
        snap = cls(**{k: v for k, v in data.items() if k in known})
        return dataclasses.replace(snap, replica_id=replica_id or snap.replica_id)


class Published(Protocol):
    """What a replica publishes: JSON on the wire, stamped with the wall clock."""

    @property
    def time(self) -> float: ...

    def to_json(self) -> str: ...


_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound=Published)
# Reads one entry: (raw JSON, replica id from the key) -> snapshot; ValueError/TypeError when bad.
Parse = Callable[[bytes, str], _S]


async def _kv(fn: Callable[_P, _R], *args: _P.args, **kw: _P.kwargs) -> _R:
    return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kw), KV_TIMEOUT_S)


async def publish(app: str, replica_id: str, snap: Published, kind: str = POOL) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    await _kv(_internal_kv_put, _prefix(app, kind) + replica_id, snap.to_json(), namespace=_NAMESPACE)


async def publish_logged(
    app: str, replica_id: str, snapshot: Callable[[], Published], kind: str = POOL, what: str = "engine stats"
) -> None:
    """One snapshot to the KV store (bounded by its timeout); a failure is logged, never raised."""
    try:
        await publish(app, replica_id, snapshot(), kind)
    except Exception as exc:  # noqa: BLE001 - stats are best effort; serving, health and exiting still work
        logger.warning("publishing %s failed: %r", what, exc)


async def publish_forever(publish_once: Callable[[], Awaitable[None]]) -> None:
    """A replica's publisher task (started by its check_health): ``publish_once`` (a
    `publish_logged`, which never raises) every PUBLISH_INTERVAL_S."""
    while True:
        await publish_once()
        await asyncio.sleep(PUBLISH_INTERVAL_S)


def _read_all(app: str, kind: str, parse: Parse[_S]) -> list[_S]:
    from ray.experimental.internal_kv import (
        _internal_kv_del,
        _internal_kv_get,
        _internal_kv_list,
    )

    prefix = _prefix(app, kind)
    out = []
    for key in _internal_kv_list(prefix, namespace=_NAMESPACE):
        raw = _internal_kv_get(key, namespace=_NAMESPACE)
        if not raw:
            continue
        try:
            snap = parse(raw, key.decode()[len(prefix) :])
        except (TypeError, ValueError):
            logger.warning("ignoring a malformed %s snapshot under %r", kind, key)
            continue
        if time.time() - snap.time > FORGET_AFTER_S:
            _internal_kv_del(key, namespace=_NAMESPACE)
            continue
        out.append(snap)
    return out


async def collect_published(app: str, kind: str, parse: Parse[_S], stale_after_s: float = STALE_AFTER_S) -> list[_S]:
    """Fresh snapshots of the application's replicas of ``kind``; [] when the KV store is unreachable."""
    try:
        snaps = await _kv(_read_all, app, kind, parse)
    except Exception:  # noqa: BLE001 - no stats is an answer ("not healthy"), not an error
        return []
    now = time.time()
    return [s for s in snaps if now - s.time <= stale_after_s]


async def collect(app: str, stale_after_s: float = STALE_AFTER_S) -> list[PoolSnapshot]:
    """Fresh snapshots of the application's worker replicas; [] when the KV store is unreachable."""
    return await collect_published(app, POOL, PoolSnapshot.from_json, stale_after_s)


def num_alive(snaps: Sequence[PoolSnapshot]) -> int:
    return sum(1 for s in snaps if s.alive)


def any_alive(snaps: Sequence[PoolSnapshot]) -> bool:
    return num_alive(snaps) > 0

"""Every worker replica's engine stats, for /health and /metrics of the whole pool.

A Serve handle reaches one replica of the router's choosing, so asking through it says nothing
about the others. Instead each worker replica publishes a small JSON snapshot of its engine
(``AsyncEngine.stats()``) to the Ray cluster's internal KV store every ``PUBLISH_INTERVAL_S``,
under a key per application and replica; the ingress lists the application's keys. A replica
that died stops publishing and its entry goes stale (ignored after ``STALE_AFTER_S``). Every
KV call runs in a thread under a bounded wait: a slow GCS makes stats late, never a hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from typing import Any

PUBLISH_INTERVAL_S = 1.0
STALE_AFTER_S = 5.0
FORGET_AFTER_S = 300.0  # entries of replicas gone this long are deleted by the next reader
KV_TIMEOUT_S = 2.0
_NAMESPACE = "logitpool"


def _prefix(app: str) -> str:
    return f"pool/{app}/"


def _number(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def snapshot(stats: Any, **extra: Any) -> dict[str, Any]:
    """A JSON-able snapshot of an EngineStats, stamped with wall-clock time. Only finite numbers
    of `kv` are kept: whatever an engine puts there, publishing (hence health) cannot fail on it."""
    snap = {**dataclasses.asdict(stats), **extra, "time": time.time()}
    kv = {str(k): _number(v) for k, v in (snap.get("kv") or {}).items()}
    snap["kv"] = {k: v for k, v in kv.items() if v is not None}
    snap["finished"] = {str(k): int(v) for k, v in (snap.get("finished") or {}).items()}
    return snap


async def _kv(fn: Any, *args: Any, **kw: Any) -> Any:
    return await asyncio.wait_for(asyncio.to_thread(fn, *args, **kw), KV_TIMEOUT_S)


async def publish(app: str, replica_id: str, snap: dict[str, Any]) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    await _kv(_internal_kv_put, _prefix(app) + replica_id, json.dumps(snap), namespace=_NAMESPACE)


def _read_all(app: str) -> list[dict[str, Any]]:
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list

    out = []
    for key in _internal_kv_list(_prefix(app), namespace=_NAMESPACE):
        raw = _internal_kv_get(key, namespace=_NAMESPACE)
        if not raw:
            continue
        snap = json.loads(raw)
        if time.time() - snap.get("time", 0.0) > FORGET_AFTER_S:
            _internal_kv_del(key, namespace=_NAMESPACE)
            continue
        snap["replica_id"] = key.decode()[len(_prefix(app)):]
        out.append(snap)
    return out


async def collect(app: str, stale_after_s: float = STALE_AFTER_S) -> list[dict[str, Any]]:
    """Fresh snapshots of the application's worker replicas; [] when the KV store is unreachable."""
    try:
        snaps = await _kv(_read_all, app)
    except Exception:  # noqa: BLE001 - no stats is an answer ("not healthy"), not an error
        return []
    now = time.time()
    return [s for s in snaps if now - s.get("time", 0.0) <= stale_after_s]


def any_alive(snaps: list[dict[str, Any]]) -> bool:
    return any(s.get("alive") for s in snaps)

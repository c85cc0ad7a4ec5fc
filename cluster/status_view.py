"""`logitpool status` as text: Serve's view of each deployment (replica states, messages such as
replicas waiting for resources) and each worker replica's engine (running, waiting, KV cache)."""

from __future__ import annotations

from typing import Any


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


def _kv(snap: dict[str, Any]) -> str:
    stats = {**(snap.get("kv") or {})}
    if snap.get("kv_cache_bytes"):
        stats["bytes"] = snap["kv_cache_bytes"]
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(stats.items())) or "-"


def status_lines(app: str, st: Any | None, snaps: list[dict[str, Any]]) -> list[str]:
    """`st`: Serve's ApplicationStatusOverview (None: not deployed); `snaps`: pool_stats.collect."""
    if st is None:
        return [f"application {app}: not deployed"]
    lines = [f"application {app}: {_value(st.status)}"]
    for name, d in sorted(st.deployments.items()):
        states = " ".join(f"{_value(k)}={v}" for k, v in sorted((d.replica_states or {}).items(), key=str)) or "none"
        lines.append(f"  {name}: {_value(d.status)}  replicas: {states}")
        if d.message:
            lines.append(f"    {' '.join(d.message.split())}")
    lines.append(f"worker replicas reporting: {len(snaps)}")
    if snaps:
        lines.append(f"  {'replica':<24} {'alive':<5} {'running':>7} {'waiting':>7}  kv")
        for s in sorted(snaps, key=lambda s: s.get("replica_id", "")):
            lines.append(f"  {s.get('replica_id', '?'):<24} {'yes' if s.get('alive') else 'NO':<5} "
                         f"{s.get('num_running', 0):>7} {s.get('num_waiting', 0):>7}  {_kv(s)}")
    return lines

"""`logitpool status` as text: Serve's view of each deployment (replica states, messages such as
replicas waiting for resources) and each worker replica's engine (running, waiting, KV cache)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cluster.pool_stats import PoolSnapshot

if TYPE_CHECKING:
    from ray.serve.schema import ApplicationStatusOverview

# (header, how one snapshot fills the cell); counts are integers, rates percentages.
_COLUMNS: tuple[tuple[str, Callable[[PoolSnapshot], str]], ...] = (
    ("replica", lambda s: s.replica_id or "?"),
    ("alive", lambda s: "yes" if s.alive else "NO"),
    ("running", lambda s: str(s.num_running)),
    ("waiting", lambda s: str(s.num_waiting)),
    ("kv used", lambda s: _count(s.kv.get("blocks_used"))),
    ("kv free", lambda s: _count(s.kv.get("blocks_free"))),
    ("kv total", lambda s: _count(s.kv.get("blocks_total"))),
    ("prefix hits", lambda s: _percent(s.kv.get("prefix_hit_rate"))),
    ("kv memory", lambda s: _bytes(s.kv_cache_bytes)),
)


def _value(x: object) -> str:
    return str(getattr(x, "value", x))


def _count(x: float | None) -> str:
    return "-" if x is None else f"{int(x):,}"


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _bytes(n: int) -> str:
    if not n:
        return "-"
    if n < 1024:
        return f"{n} B"
    x = n / 1024
    for unit in ("KiB", "MiB"):
        if x < 1024:
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} GiB"


def table(snaps: list[PoolSnapshot]) -> list[str]:
    """One aligned row per worker replica (sorted by id); text left-aligned, numbers right."""
    rows = [[fill(s) for _, fill in _COLUMNS] for s in sorted(snaps, key=lambda s: s.replica_id)]
    heads = [h for h, _ in _COLUMNS]
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(heads), *(line(r) for r in rows)]


def status_lines(app: str, st: ApplicationStatusOverview | None, snaps: list[PoolSnapshot]) -> list[str]:
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
        lines.extend("  " + row for row in table(snaps))
    return lines

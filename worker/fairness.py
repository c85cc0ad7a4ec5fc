"""Fair admission: which waiting sequence the scheduler admits next, and whom it preempts.

Every sequence belongs to a group (one client request: all its prompts and its n completions)
nested in a tenant (an API key; "" when keys are off). The policies (EngineConfig.scheduling_policy):

- ``fair`` (the default): each active tenant (one with running or waiting sequences) is entitled
  to ``ceil(rows / active tenants)`` rows of the batch, and each active group to an equal part of
  its tenant's share, rounded up. The next sequence admitted comes from a tenant below its share
  (the one whose head waited longest), else from any tenant; within that tenant from a group below
  its share, then by priority, then by the longest wait. A sequence below its share that finds no
  free row or KV block preempts the newest sequence of whoever is furthest over its share (never
  one at or below it), so a request holding every row gives way within a step. Shares only order
  and preempt: a group alone may take every row. Priority orders a tenant's own groups but never
  buys more than the share while others wait.
- ``priority``: vLLM's: admission by (priority, queue position); under KV pressure the worst
  (priority, arrival) running sequence is preempted.
- ``fcfs``: queue order; under KV pressure the newest is preempted (vLLM's default).

For one group, and for groups of one sequence each, ``fair`` admits and preempts exactly as
``fcfs`` does.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from worker.request import Request

GroupKey = tuple[str, str]  # (tenant, group)


def group_key(req: Request) -> GroupKey:
    return req.tenant, req.group


class WaitingQueue:
    """Sequences waiting for admission: one FIFO per group. ``Request.order`` is the position one
    deque would give (``appendleft`` goes before everything, ``append`` after), so every group's
    FIFO stays sorted by it and the heads are all a policy needs to look at."""

    def __init__(self) -> None:
        self._groups: dict[GroupKey, deque[Request]] = {}
        self._front = 0
        self._back = 0
        self._len = 0

    def append(self, req: Request) -> None:
        req.order, self._back = self._back, self._back + 1
        self._groups.setdefault(group_key(req), deque()).append(req)
        self._len += 1

    def appendleft(self, req: Request) -> None:
        self._front -= 1
        req.order = self._front
        self._groups.setdefault(group_key(req), deque()).appendleft(req)
        self._len += 1

    def remove(self, req: Request) -> bool:
        """Take ``req`` out wherever it is; False if it was not waiting."""
        key = group_key(req)
        q = self._groups.get(key)
        if q is None or not any(r is req for r in q):
            return False
        q.remove(req)
        self._len -= 1
        if not q:
            del self._groups[key]
        return True

    def heads(self) -> Iterator[tuple[GroupKey, Request]]:
        for key, q in self._groups.items():
            yield key, q[0]

    def group_keys(self) -> Iterable[GroupKey]:
        return self._groups.keys()

    def __len__(self) -> int:
        return self._len

    def __contains__(self, req: object) -> bool:
        return isinstance(req, Request) and any(r is req for r in self._groups.get(group_key(req), ()))

    def __iter__(self) -> Iterator[Request]:
        """In queue order (what one deque would hold)."""
        return iter(sorted((r for q in self._groups.values() for r in q), key=lambda r: r.order))


@dataclass
class Shares:
    """Rows held per tenant and group, and what each is entitled to, during one schedule()."""

    held_t: Counter[str]
    held_g: Counter[GroupKey]
    share_t: int
    share_g: dict[str, int]

    @classmethod
    def of(cls, running: Iterable[Request], waiting: WaitingQueue, rows: int) -> Shares:
        held_g = Counter(group_key(r) for r in running)
        held_t: Counter[str] = Counter()
        for (tenant, _), n in held_g.items():
            held_t[tenant] += n
        groups_per_tenant = Counter(t for t, _ in set(held_g).union(waiting.group_keys()))
        share_t = math.ceil(rows / max(1, len(groups_per_tenant)))
        return cls(held_t, held_g, share_t, {t: math.ceil(share_t / n) for t, n in groups_per_tenant.items()})

    def add(self, req: Request, k: int = 1) -> None:
        self.held_t[req.tenant] += k
        self.held_g[group_key(req)] += k

    def tenant_excess(self, tenant: str) -> int:
        return self.held_t[tenant] - self.share_t

    def group_excess(self, key: GroupKey) -> int:
        return self.held_g[key] - self.share_g.get(key[0], self.share_t)

    def victim_key(self, index: int, req: Request) -> tuple[int, int, int, int]:
        """Larger = preempted first: furthest over the tenant's share, then the group's, then
        the worst priority, then the newest admitted (``index`` in the running list)."""
        return self.tenant_excess(req.tenant), self.group_excess(group_key(req)), req.priority, index


def pick(
    policy: str,
    waiting: WaitingQueue,
    shares: Shares | None,
    blocked: frozenset[GroupKey] | set[GroupKey] = frozenset(),
) -> Request | None:
    """The next sequence to admit (the head of its group), skipping ``blocked`` groups."""
    heads = [(key, r) for key, r in waiting.heads() if key not in blocked]
    if not heads:
        return None
    if policy == "fcfs":
        return min(heads, key=lambda kr: kr[1].order)[1]
    if policy == "priority":
        return min(heads, key=lambda kr: (kr[1].priority, kr[1].order))[1]
    assert shares is not None
    best: dict[str, tuple[tuple[bool, int, int], Request]] = {}
    oldest: dict[str, int] = {}
    for key, r in heads:
        tenant = key[0]
        k = (shares.group_excess(key) >= 0, r.priority, r.order)
        if tenant not in best or k < best[tenant][0]:
            best[tenant] = (k, r)
        oldest[tenant] = min(oldest.get(tenant, r.order), r.order)
    tenant = min(best, key=lambda t: (shares.tenant_excess(t) >= 0, oldest[t]))
    return best[tenant][1]


def kv_victim(policy: str, running: Sequence[Request], shares: Shares | None) -> Request:
    """The running sequence preempted when KV blocks run out (``running`` in admission order)."""
    if policy == "fcfs":
        return running[-1]
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival))
    assert shares is not None
    return max(enumerate(running), key=lambda ir: shares.victim_key(*ir))[1]


def fair_victim(req: Request, running: Sequence[Request], shares: Shares) -> Request | None:
    """Whom to preempt so ``req`` (waiting, below its share) gets a row or KV; None when no one
    is over theirs: a tenant below its share takes from tenants over theirs, a group below its
    share (in a tenant at its share) from its tenant's groups over theirs."""
    tenant = req.tenant
    if shares.tenant_excess(tenant) < 0:
        pool = [(i, r) for i, r in enumerate(running) if shares.tenant_excess(r.tenant) > 0]
    elif shares.group_excess(group_key(req)) < 0:
        pool = [(i, r) for i, r in enumerate(running) if r.tenant == tenant and shares.group_excess(group_key(r)) > 0]
    else:
        return None
    return max(pool, key=lambda ir: shares.victim_key(*ir))[1] if pool else None

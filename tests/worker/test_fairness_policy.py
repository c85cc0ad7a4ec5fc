"""worker.fairness against a plain reference: one flat queue, every share recomputed from scratch,
every waiting sequence scored by the policy's definition. No model: the policy alone.

Random operations (requests arriving in groups and tenants, admissions into a fixed number of
rows, finishes, preemptions back to the front, groups blocked for a step) drive the real
``WaitingQueue`` + ``pick`` / ``kv_victim`` / ``fair_victim`` and the reference side by side;
every choice must be the same sequence."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.fairness import Shares, WaitingQueue, fair_victim, group_key, kv_victim, pick
from worker.request import Request
from worker.sampling_params import SamplingParams


def seq(rid: str, tenant: str, group: str, priority: int) -> Request:
    return Request(
        rid,
        rid,
        0,
        [1],
        SamplingParams(),
        None,
        group=group,
        tenant=tenant,
        priority=priority,
    )


# -- the reference: a flat list in queue order, nothing incremental ----------------------------


def ref_shares(running: list[Request], queue: list[Request], rows: int) -> tuple[int, dict[str, int]]:
    groups = {(r.tenant, r.group) for r in running + queue}
    tenants = {t for t, _ in groups}
    share_t = math.ceil(rows / max(1, len(tenants)))
    return share_t, {t: math.ceil(share_t / sum(1 for u, _ in groups if u == t)) for t in tenants}


def ref_pick(policy: str, queue: list[Request], running: list[Request], rows: int, blocked: set) -> Request | None:
    cands = [(i, r) for i, r in enumerate(queue) if (r.tenant, r.group) not in blocked]
    if not cands:
        return None
    if policy == "fcfs":
        return cands[0][1]
    if policy == "priority":
        return min(cands, key=lambda ir: (ir[1].priority, ir[0]))[1]
    share_t, share_g = ref_shares(running, queue, rows)

    def held(pred) -> int:
        return sum(1 for r in running if pred(r))

    def score(i: int, r: Request) -> tuple:
        t_held = held(lambda x: x.tenant == r.tenant)
        g_held = held(lambda x: (x.tenant, x.group) == (r.tenant, r.group))
        first_of_tenant = min(j for j, x in cands if x.tenant == r.tenant)
        return (t_held >= share_t, first_of_tenant), (g_held >= share_g[r.tenant], r.priority, i)

    return min(cands, key=lambda ir: score(*ir))[1]


def ref_excess(r: Request, running: list[Request], queue: list[Request], rows: int) -> tuple[int, int]:
    share_t, share_g = ref_shares(running, queue, rows)
    t = sum(1 for x in running if x.tenant == r.tenant) - share_t
    g = sum(1 for x in running if (x.tenant, x.group) == (r.tenant, r.group)) - share_g[r.tenant]
    return t, g


def ref_kv_victim(policy: str, running: list[Request], queue: list[Request], rows: int) -> Request:
    if policy == "fcfs":
        return running[-1]
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival))
    return max(enumerate(running), key=lambda ir: (*ref_excess(ir[1], running, queue, rows), ir[1].priority, ir[0]))[1]


def ref_fair_victim(req: Request, running: list[Request], queue: list[Request], rows: int) -> Request | None:
    t_ex, g_ex = ref_excess(req, running, queue, rows)
    if t_ex < 0:
        pool = [(i, r) for i, r in enumerate(running) if ref_excess(r, running, queue, rows)[0] > 0]
    elif g_ex < 0:
        pool = [
            (i, r)
            for i, r in enumerate(running)
            if r.tenant == req.tenant and ref_excess(r, running, queue, rows)[1] > 0
        ]
    else:
        return None
    if not pool:
        return None
    return max(pool, key=lambda ir: (*ref_excess(ir[1], running, queue, rows), ir[1].priority, ir[0]))[1]


# -- the driver ------------------------------------------------------------------------------

_add = st.tuples(st.just("add"), st.sampled_from(["", "k1", "k2"]), st.integers(1, 9), st.integers(-2, 2))
_admit = st.tuples(st.just("admit"), st.integers(1, 12))
ops = st.lists(
    st.one_of(
        _add,
        _add,
        _admit,
        _admit,
        st.tuples(st.just("finish"), st.integers(0, 63)),
        st.tuples(st.just("kv"), st.just(0)),
        st.tuples(st.just("block"), st.integers(0, 63)),
    ),
    min_size=10,
    max_size=80,
)


@pytest.mark.parametrize("policy", ["fair", "priority", "fcfs"])
@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 12), script=ops)
def test_admission_and_preemption_match_the_reference(policy: str, rows: int, script: list[tuple]) -> None:
    queue = WaitingQueue()
    flat: list[Request] = []  # the reference's queue, in order
    running: list[Request] = []
    blocked: set = set()
    arrivals = Counter[str]()
    groups = 0

    def requeue_front(r: Request) -> None:
        queue.appendleft(r)
        flat.insert(0, r)

    for op in script:
        if op[0] == "add":
            _, tenant, n, prio = op
            groups += 1
            for i in range(n):
                r = seq(f"g{groups}.{i}", tenant, f"g{groups}", prio)
                r.arrival = sum(arrivals.values())
                arrivals[r.request_id] += 1
                queue.append(r)
                flat.append(r)
        elif op[0] == "admit":
            shares = Shares.of(running, queue, rows)
            for _ in range(op[1]):  # admissions within one step: shares updated incrementally
                got = pick(policy, queue, shares if policy == "fair" else None, blocked)
                want = ref_pick(policy, flat, running, rows, blocked)
                assert got is want
                if got is None:
                    break
                if len(running) >= rows:
                    if policy != "fair":
                        break
                    victim = fair_victim(got, running, shares)
                    assert victim is ref_fair_victim(got, running, flat, rows)
                    if victim is None:
                        break
                    running.remove(victim)
                    shares.add(victim, -1)
                    requeue_front(victim)
                    blocked.add(group_key(victim))  # as the scheduler: not readmitted this step
                    continue
                assert queue.remove(got)
                flat.remove(got)
                running.append(got)
                shares.add(got)
                assert shares == Shares.of(running, queue, rows), "incremental shares drifted"
            blocked.clear()
        elif op[0] == "finish" and running:
            running.pop(op[1] % len(running))
        elif op[0] == "kv" and running:
            shares = Shares.of(running, queue, rows)
            victim = kv_victim(policy, running, shares)
            assert victim is ref_kv_victim(policy, running, flat, rows)
            running.remove(victim)
            requeue_front(victim)
        elif op[0] == "block" and flat:
            blocked.add(group_key(flat[op[1] % len(flat)]))
        assert list(queue) == flat and len(queue) == len(flat)


def test_one_group_and_single_sequence_groups_admit_in_queue_order() -> None:
    """What keeps single requests and uniform batches byte-for-byte as before: fair == fcfs."""
    for make in (lambda i: seq(f"a{i}", "", "g", 0), lambda i: seq(f"s{i}", "", f"g{i}", 0)):
        queue = WaitingQueue()
        reqs = [make(i) for i in range(10)]
        for r in reqs:
            queue.append(r)
        queue.remove(reqs[7])
        queue.appendleft(reqs[7])  # a preempted one goes first
        running: list[Request] = []
        shares = Shares.of(running, queue, 4)
        order = []
        while (r := pick("fair", queue, shares)) is not None:
            assert r is pick("fcfs", queue, None)
            queue.remove(r)
            running.append(r)
            shares.add(r)
            order.append(r)
        assert order[0] is reqs[7]


def test_a_hog_holding_every_row_gives_one_to_a_newcomer() -> None:
    hog = [seq(f"h{i}", "", "hog", 0) for i in range(12)]
    queue, running = WaitingQueue(), hog[:8]
    for r in hog[8:]:
        queue.append(r)
    small = seq("s", "", "small", 0)
    queue.append(small)
    shares = Shares.of(running, queue, 8)
    assert pick("fair", queue, shares) is small and pick("fcfs", queue, None) is hog[8]
    assert fair_victim(small, running, shares) is hog[7]  # the hog's newest
    # Once the small one runs, a hog sequence (over its share) never preempts it.
    running.remove(hog[7])
    shares.add(hog[7], -1)
    queue.remove(small)
    running.append(small)
    shares.add(small)
    queue.appendleft(hog[7])
    assert pick("fair", queue, shares) is hog[7] and fair_victim(hog[7], running, shares) is None

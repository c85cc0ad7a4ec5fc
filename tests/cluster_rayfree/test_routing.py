"""Cache-aware routing without a Ray cluster: the digest rule against the worker's real cache,
reports, the index and the policy against a plain reference under random interleavings of
report / guess / time / route, and Serve's RequestRouter (the real class) over fake replicas."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.routing.blocks import DigestMemo, lookup_blocks, prompt_digests
from cluster.routing.config import RoutingConfig
from cluster.routing.index import PrefixIndex
from cluster.routing.policy import Candidate, decide
from cluster.routing.report import STATS_KEY, Reporter, RoutingReport
from cluster.routing.router import PROMPT_ARG, CacheAwareRouter, request_prompt
from cluster.worker_deployment import LogitpoolWorker
from worker import AsyncEngine, SamplingParams
from worker.config import EngineConfig
from worker.kv import CachedBlocks, hash_block

BS = 4


def chain(tokens: list[int], block_size: int = BS):
    """The worker's addresses of the full blocks of ``tokens`` (worker.kv.hash_block)."""
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


# -- digests -------------------------------------------------------------------------------


def test_digests_are_the_workers_chain_named_the_same_in_any_process():
    tokens = list(range(100, 137))
    addresses = chain(tokens)
    entries = DigestMemo().of(reversed(addresses))  # any order: parents are found through the chain
    digests = prompt_digests(tokens, BS)
    assert [entries[a] for a in addresses] == list(enumerate(digests))
    assert len(set(digests)) == len(digests) == len(tokens) // BS
    # Another interpreter, with another hash seed (str hashes and 3.11's hash(None) differ there).
    code = f"from cluster.routing.blocks import prompt_digests; print(prompt_digests({tokens!r}, {BS}))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(digests)


def test_a_digest_names_the_whole_prefix_and_lookup_spares_the_last_token():
    a, b = prompt_digests([1, 2, 3, 4, 5, 6, 7, 8], BS), prompt_digests([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert [lookup_blocks(n, BS) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


def test_the_memo_hashes_only_new_blocks_and_forgets_evicted_ones():
    memo = DigestMemo()
    first = chain(list(range(16)))
    memo.of(first[:2])
    grown = memo.of(first)
    assert [d for _, d in (grown[a] for a in first)] == prompt_digests(list(range(16)), BS)
    assert set(memo.of(first[:1])) == {first[0]}


# -- reports ---------------------------------------------------------------------------------


def cached(addresses, free: int = 3, total: int = 10) -> CachedBlocks:
    return CachedBlocks(tuple(addresses), free, total)


def test_a_report_is_bounded_shallowest_first_and_reads_back():
    deep, other = chain(list(range(40))), chain(list(range(50, 58)))
    reporter = Reporter(max_blocks=4, block_size=BS)
    report = reporter.report(cached(deep + other), num_running=2, num_waiting=1)
    assert report.num_cached == len(deep) + len(other) and report.num_published == 4
    want = set(prompt_digests(list(range(40)), BS)[:2]) | set(prompt_digests(list(range(50, 58)), BS))
    assert report.digest_set() == want
    again = RoutingReport.from_stats(report.to_stats())
    assert again == report and (again.num_free, again.num_blocks, again.num_running) == (3, 10, 2)
    assert reporter.report(cached(deep), 0, 0).seq == report.seq + 1


@pytest.mark.parametrize(
    "stats",
    [None, {}, {STATS_KEY: "x"}, {STATS_KEY: {"seq": 1}}, {"other": 1}],
)
def test_no_report_or_a_malformed_one_reads_as_none(stats):
    assert RoutingReport.from_stats(stats) is None


def test_a_report_with_a_torn_digest_string_is_refused():
    good = Reporter(4, BS).report(cached(chain(list(range(8)))), 0, 0).to_stats()
    good[STATS_KEY]["digests"] = good[STATS_KEY]["digests"][:-1]
    assert RoutingReport.from_stats(good) is None


# -- the index and the policy against a plain reference ----------------------------------------

TTL, STALE, MAX_GUESSES = 3.0, 5.0, 3
Digest = st.integers(1, 6)
Load = st.integers(0, 20)


@dataclass
class RefReplica:
    seen: float
    seq: int = -1
    reported: set[int] = field(default_factory=set)
    guesses: list[tuple[int, float]] = field(default_factory=list)  # (digest, expiry), oldest first


class Reference:
    """The index written the obvious way: lists and full scans."""

    def __init__(self) -> None:
        self.replicas: dict[str, RefReplica] = {}

    def live(self, r: str, now: float) -> RefReplica | None:
        rep = self.replicas.get(r)
        if rep is not None and now - rep.seen > STALE:
            del self.replicas[r]
            return None
        return rep

    def report(self, r: str, seq: int, digests: set[int], now: float) -> None:
        rep = self.replicas.get(r)
        if rep is not None and rep.seq == seq:
            return
        if rep is None:
            rep = self.replicas[r] = RefReplica(seen=now)
        rep.seq, rep.reported, rep.seen = seq, set(digests), now
        rep.guesses = [(d, e) for d, e in rep.guesses if d not in digests]

    def guess(self, r: str, digests: list[int], now: float) -> None:
        rep = self.live(r, now)
        if rep is None:
            rep = self.replicas[r] = RefReplica(seen=now)
        for d in digests:
            if d not in rep.reported:
                rep.guesses = [(g, e) for g, e in rep.guesses if g != d] + [(d, now + TTL)]
        rep.guesses = [(g, e) for g, e in rep.guesses if e > now][-MAX_GUESSES:]

    def matched(self, r: str, digests: list[int], now: float) -> int:
        rep = self.live(r, now)
        if rep is None:
            return 0
        held = rep.reported | {g for g, e in rep.guesses if e > now}
        n = 0
        while n < len(digests) and digests[n] in held:
            n += 1
        return n


def report_of(seq: int, digests: set[int], load: int = 0) -> RoutingReport:
    data = b"".join(d.to_bytes(8, "little") for d in sorted(digests))
    return RoutingReport(seq, BS, data, len(digests), 0, 10, load, 0)


REPLICAS = ["r1", "r2", "r3"]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("report"), st.sampled_from(REPLICAS), st.integers(0, 3), st.sets(Digest, max_size=5)),
        st.tuples(st.just("guess"), st.sampled_from(REPLICAS), st.lists(Digest, max_size=4)),
        st.tuples(st.just("tick"), st.floats(0.0, 4.0)),
        st.tuples(st.just("drop"), st.sampled_from(REPLICAS)),
        st.tuples(st.just("unguess"), st.sampled_from(REPLICAS), st.lists(Digest, max_size=3)),
        st.tuples(
            st.just("route"),
            st.lists(Digest, min_size=1, max_size=5),
            st.lists(st.integers(0, 20), min_size=3, max_size=3),
        ),
    ),
    max_size=40,
)


def ref_decide(matched: dict[str, int], loads: dict[str, int], n: int, threshold: int, fraction: float):
    """The policy the obvious way: drop the overloaded, then keep the longest prefix."""
    if max(matched.values()) == 0 or max(matched.values()) < fraction * n:
        return ()
    least = min(loads.values())
    ok = {r: m for r, m in matched.items() if loads[r] - least <= threshold}
    top = max(ok.values())
    if top == 0 or top < fraction * n:
        return ()
    return tuple(r for r in REPLICAS if ok.get(r) == top)


@given(ops, st.integers(0, 10), st.sampled_from([0.0, 0.3, 1.0]))
def test_index_and_policy_match_the_reference_under_any_interleaving(ops, threshold, fraction):
    index, ref, now = PrefixIndex(guess_ttl_s=TTL, stale_after_s=STALE, max_guesses=MAX_GUESSES), Reference(), 0.0
    for op in ops:
        kind = op[0]
        if kind == "report":
            _, r, seq, digests = op
            index.on_report(r, report_of(seq, digests), now)
            ref.report(r, seq, digests, now)
        elif kind == "guess":
            index.guess(op[1], op[2], now)
            ref.guess(op[1], op[2], now)
        elif kind == "tick":
            now += op[1]
        elif kind == "drop":
            index.drop(op[1])
            ref.replicas.pop(op[1], None)
        elif kind == "unguess":
            index.unguess(op[1], op[2])
            if op[1] in ref.replicas:
                ref.replicas[op[1]].guesses = [(g, e) for g, e in ref.replicas[op[1]].guesses if g not in op[2]]
        else:
            _, digests, loads = op
            matched = {r: index.matched(r, digests, now) for r in REPLICAS}
            assert matched == {r: ref.matched(r, digests, now) for r in REPLICAS}
            cands = [Candidate(r, load, matched[r]) for r, load in zip(REPLICAS, loads)]
            got = decide(cands, len(digests), imbalance_threshold=threshold, min_match_fraction=fraction)
            assert got.preferred == ref_decide(matched, dict(zip(REPLICAS, loads)), len(digests), threshold, fraction)
            assert (got.reason == "cache") == bool(got.preferred)
    for r in REPLICAS:
        live = ref.live(r, now)
        size = index.sizes(now).get(r)
        assert (size is None) == (live is None)
        if live is not None and size is not None:
            assert size.reported == len(live.reported)
            assert size.guessed == len([g for g, e in live.guesses if e > now])


# -- Serve's RequestRouter over fake replicas ------------------------------------------------


class FakeReplica:
    """What a RequestRouter reads of a running replica (ray.serve.request_router.RunningReplica)."""

    def __init__(self, name: str, queue_len: int = 0) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(name, DeploymentID(name="LogitpoolWorker", app_name="app"))
        self.routing_stats: dict = {}
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "node", None, set()
        self.max_ongoing_requests = 100
        self.queue_len = queue_len
        self.seq = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len

    def publish(self, tokens_list: list[list[int]], *, load: int = 0) -> None:
        self.seq += 1
        addresses = [a for tokens in tokens_list for a in chain(tokens)]
        self.routing_stats = Reporter(4096, BS).report(cached(addresses), load, 0).to_stats()
        self.routing_stats[STATS_KEY]["seq"] = self.seq


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_router(clock: Clock, **routing) -> CacheAwareRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = CacheAwareRouter(
        deployment_id=DeploymentID(name="LogitpoolWorker", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
        get_curr_time_s=clock,
    )
    router.initialize_state(**RoutingConfig(**routing).model_dump(exclude={"policy"}))
    return router


def call(tokens: list[int] | None, rid: str = "q", method: str = "generate"):
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    args = ["user-id", tokens, None, None] if tokens is not None else []
    return PendingRequest(
        args=args, kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method)
    )


def preferred(ranks) -> set[str]:
    return {r.replica_id.unique_id for r in ranks[0]}


async def replicas_known(router: CacheAwareRouter, replicas: list[FakeReplica]) -> None:
    """Serve's update, then its probes of the new replicas' queue lengths (tasks of their own)."""
    router.update_replicas(replicas)
    await asyncio.sleep(0.01)


def test_the_router_reads_the_prompt_where_the_worker_takes_it():
    assert list(inspect.signature(LogitpoolWorker.generate).parameters)[PROMPT_ARG + 1] == "prompt"  # after self

    async def main():  # a PendingRequest makes its future on the running loop
        assert request_prompt(call([1, 2, 3])) == [1, 2, 3]
        assert request_prompt(call([1, 2], method="info")) is None
        assert request_prompt(call(None)) is None

    asyncio.run(main())


def test_router_prefers_the_reporting_replica_then_guesses_follow_routing():
    clock = Clock()
    tenant = list(range(200, 240))  # 10 blocks
    turn1 = list(range(300, 340))

    async def main():
        router = make_router(clock)
        # r3 is busier, so never the one a request with no preference is guessed on.
        r1, r2, r3 = FakeReplica("r1"), FakeReplica("r2"), FakeReplica("r3", queue_len=1)
        r2.publish([tenant])
        for r in (r1, r3):
            r.publish([])
        await replicas_known(router, [r1, r2, r3])
        a = call([*tenant, 7, 8, 9], "a")
        ranks = await router.choose_replicas(router._replicas_list, a)
        assert preferred(ranks) == {"r2"} and len(ranks) == 2  # then power of two
        router.on_request_routed(a, r2.replica_id, None)
        # A conversation's first turn, guessed on the less loaded of a pair but placed by Serve on
        # r3 (the other was full, say); its second turn follows it there before any report says
        # so (the guess, taken back from the first choice), and a report confirming it keeps it.
        first = call(turn1, "t1")
        await router.choose_replicas(router._replicas_list, first)
        router.on_request_routed(first, r3.replica_id, None)
        second = [*turn1, 1, 2, 3, 4, 5, 6]
        ranks = await router.choose_replicas(router._replicas_list, call(second, "t2"))
        assert preferred(ranks) == {"r3"}
        r3.publish([turn1])
        clock.now += 20  # guesses expired: only the report holds the first turn now
        for r in (r1, r2):
            r.publish([tenant] if r is r2 else [])
        await replicas_known(router, [r1, r2, r3])
        ranks = await router.choose_replicas(router._replicas_list, call(second, "t3"))
        assert preferred(ranks) == {"r3"}
        counts = router.stats.counts()
        assert counts.routed == {("r2", "cache"): 1, ("r3", "load"): 1}
        assert counts.reports == 6 and counts.report_bytes > 0

    asyncio.run(main())


def test_requests_with_one_new_prefix_routed_together_go_to_one_replica():
    """The first is not placed yet when the second is routed: the first's choice is guessed at once."""
    clock = Clock()
    system = list(range(500, 600))

    async def main():
        router = make_router(clock)
        replicas = [FakeReplica(f"r{i}") for i in range(4)]
        for r in replicas:
            r.publish([])
        await replicas_known(router, replicas)
        targets = set()
        for i in range(6):
            ranks = await router.choose_replicas(router._replicas_list, call([*system, i, i, i], f"q{i}"))
            targets |= preferred(ranks)
        assert len(targets) == 1

    asyncio.run(main())


def test_the_calls_of_one_ingress_request_share_serves_request_id_and_each_is_routed():
    """A batch's prompts are separate `generate` calls with one internal request id; each gets a
    replica (Serve's own matching by that id would route all but the first for ever), routed by
    its own prompt."""
    clock = Clock()
    tenant = list(range(200, 240))

    async def main():
        router = make_router(clock)
        r1, r2 = FakeReplica("r1"), FakeReplica("r2", queue_len=1)
        r1.publish([])
        r2.publish([tenant])
        await replicas_known(router, [r1, r2])
        calls = [call([*tenant, 5], "batch"), call(list(range(700, 740)), "batch"), call([*tenant, 6], "batch")]
        placed = await asyncio.wait_for(
            asyncio.gather(*(router._choose_replica_for_request(c) for c in calls)), timeout=30
        )
        assert [p.replica_id.unique_id for p in placed] == ["r2", "r1", "r2"]
        for c, p in zip(calls, placed):
            router.on_request_routed(c, p.replica_id, None)
        assert router.stats.counts().routed == {("r2", "cache"): 2, ("r1", "load"): 1}

    asyncio.run(main())


def test_router_routes_by_load_when_imbalanced_unmatched_or_not_a_generate_call():
    clock = Clock()
    tenant = list(range(200, 240))

    async def main():
        router = make_router(clock, imbalance_threshold=2)
        r1, r2 = FakeReplica("r1"), FakeReplica("r2")
        r1.publish([tenant])
        r2.publish([])
        r1.queue_len = 5
        await replicas_known(router, [r1, r2])
        for request in (call([*tenant, 1], "a"), call(list(range(900, 940)), "b")):
            ranks = await router.choose_replicas(router._replicas_list, request)
            assert preferred(ranks) == {"r2"} and len(ranks) == 2  # the less loaded of the pair, then the pair
        ranks = await router.choose_replicas(router._replicas_list, call(tenant, "c", method="info"))
        assert len(ranks) == 1  # Serve's power-of-two pair only
        router.on_new_queue_len_info(r1.replica_id, 2)  # what a reply from r1 says
        ranks = await router.choose_replicas(router._replicas_list, call([*tenant, 1], "d"))
        # r1 reported the prefix; r2 will hold it too, for "a" went there by load (guessed).
        assert preferred(ranks) == {"r1", "r2"}

    asyncio.run(main())


def test_a_replica_that_dies_leaves_or_goes_silent_loses_its_index():
    clock = Clock()
    tenant = list(range(200, 240))
    request = [*tenant, 1]

    async def main():
        router = make_router(clock, stats_period_s=1.0)
        r1, r2, r3 = FakeReplica("r1"), FakeReplica("r2"), FakeReplica("r3")
        for r in (r1, r2, r3):
            r.publish([tenant])
        await replicas_known(router, [r1, r2, r3])
        ranks = await router.choose_replicas(router._replicas_list, call(request, "a"))
        assert preferred(ranks) == {"r1", "r2", "r3"}
        router.on_replica_actor_died(r1.replica_id)  # killed
        await replicas_known(router, [r2, r3])
        ranks = await router.choose_replicas(router._replicas_list, call(request, "b"))
        assert preferred(ranks) == {"r2", "r3"}
        await replicas_known(router, [r3])  # r2 drained
        assert "r2" not in router.stats.counts().index
        # r3 stops reporting: the controller re-sends its last report, which never gets fresher.
        clock.now += 6
        await replicas_known(router, [r3])
        assert router.stats.counts().index == {}
        for rid in ("c", "d"):
            if rid == "d":
                r3.publish([tenant])  # and it is back
                await replicas_known(router, [r3])
            routed = call(request, rid)
            await router.choose_replicas(router._replicas_list, routed)
            router.on_request_routed(routed, r3.replica_id, None)
        assert router.stats.counts().routed == {("r3", "load"): 1, ("r3", "cache"): 1}
        r4 = FakeReplica("r4")  # added: no report yet, so nothing is believed cached there
        await replicas_known(router, [r3, r4])
        ranks = await router.choose_replicas(router._replicas_list, call(request, "e"))
        assert preferred(ranks) == {"r3"} and set(router.stats.counts().index) == {"r3"}

    asyncio.run(main())


# -- the worker replica's report, from the real engine ---------------------------------------


def test_the_worker_reports_the_blocks_its_engine_cached(tiny_model):
    """LogitpoolWorker over a real AsyncEngine: after a request, its report (taken on the engine
    thread) holds the digests the router computes from the same token ids."""

    async def main():
        cfg = EngineConfig(max_num_seqs=4, block_size=16, load_entry_points=False)
        worker = LogitpoolWorker(
            cfg.as_kwargs(), engine_factory=lambda c: AsyncEngine(c, loaded=tiny_model), published_blocks=4096
        )
        idle = RoutingReport.from_stats(await worker.record_routing_stats())
        assert idle is not None and idle.num_cached == 0 and idle.block_size == 16
        prompt = list(range(10, 10 + 70))
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        async for _ in worker.generate("r1", prompt, params):
            pass
        report = RoutingReport.from_stats(await worker.record_routing_stats())
        assert report is not None and report.seq == idle.seq + 1
        assert set(prompt_digests(prompt, 16)) <= report.digest_set()
        assert report.num_free + report.num_cached >= len(prompt) // 16 and report.num_blocks > 0
        off = LogitpoolWorker(cfg.as_kwargs(), engine_factory=lambda c: AsyncEngine(c, loaded=tiny_model))
        assert await off.record_routing_stats() == {}
        await worker.engine.shutdown()

    asyncio.run(main())


def test_the_cost_bench_routes_no_sharing_prompts_by_load_under_both_routers(capsys):
    """`bench routing --cost`'s premise: no block of a no-sharing prompt matches a full report, so
    the cache-aware router decides by load (its fallback is Serve's power-of-two pair)."""
    from cluster.cli import bench_routing_cost

    args = ["--replicas", "3", "--blocks", "64", "--decisions", "20", "--reports", "2", "--prompt-min", "40"]
    costs = asyncio.run(bench_routing_cost.amain(bench_routing_cost.parse(args)))
    assert [c.policy for c in costs] == ["cache_aware", "power_of_two"]
    assert [c.decisions for c in costs] == [20, 20] and [c.by_cache for c in costs] == [0, -1]
    assert all(0 < c.us_p50 <= c.us_p99 for c in costs)
    assert "| cache_aware |" in capsys.readouterr().out

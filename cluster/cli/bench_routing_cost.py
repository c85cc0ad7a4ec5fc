"""`logitpool bench routing --cost`: what cache-aware routing costs per request, against Serve's
power-of-two router, in one process and one run (no replicas, no model).

Why: on the no-sharing control the two policies place requests alike (no block ever matches, so
the cache-aware router falls back to the same power-of-two pair), so their throughput can differ
only by what routing itself costs: the ingress's CPU per decision, and each replica's CPU per
report. Both are measured here directly, where a served run's ±20 % run-to-run spread on a shared
machine would hide a 5 % difference.

Each decision routes a fresh no-sharing prompt (512–1,024 random tokens) over R fake replicas
whose last reports are full (`routing.max_published_blocks` digests each, none matching): the
router's worst case, every block of the prompt looked up against every replica's index.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RequestRouter

from cluster.routing.config import RoutingConfig
from cluster.routing.report import Reporter
from cluster.routing.router import CacheAwareRouter
from worker.kv import CachedBlocks, hash_block

DEPLOYMENT = DeploymentID(name="LogitpoolWorker", app_name="bench")
POLICIES = ("cache_aware", "power_of_two")


class _Replica:
    """What a RequestRouter reads of a running replica (ray.serve.request_router.RunningReplica)."""

    def __init__(self, name: str, routing_stats: dict[str, Any]) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.routing_stats = routing_stats
        self.node_id, self.availability_zone = "node", None
        self.multiplexed_model_ids: set[str] = set()
        self.max_ongoing_requests = 1000

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _addresses(rng: random.Random, n_blocks: int, block_size: int) -> list[Any]:
    """The worker's chained block addresses of ``n_blocks`` random blocks (worker.kv.hash_block)."""
    out, parent = [], None
    for _ in range(n_blocks):
        parent = hash_block(parent, [rng.randrange(3000) for _ in range(block_size)])
        out.append(parent)
    return out


def _request(rng: random.Random, i: int, lo: int, hi: int) -> PendingRequest:
    prompt = [rng.randrange(3000) for _ in range(rng.randint(lo, hi))]
    rid = f"r{i}"
    meta = RequestMetadata(request_id=rid, internal_request_id=rid, call_method="generate")
    return PendingRequest(args=[rid, prompt, None, None], kwargs={}, metadata=meta)


@dataclass(frozen=True)
class Cost:
    policy: str
    decisions: int
    us_mean: float
    us_p50: float
    us_p99: float
    by_cache: int  # decisions the cache made (0 on no-sharing prompts; -1: not a cache-aware router)


async def _time_router(router: RequestRouter, policy: str, replicas: list[_Replica], args: argparse.Namespace) -> Cost:
    router.update_replicas(replicas)  # type: ignore[arg-type]  # the fields RunningReplica's readers use
    await asyncio.sleep(0.05)  # Serve's probes of the new replicas' queue lengths
    rng = random.Random(args.seed)
    times = []
    for i in range(args.decisions):
        request = _request(rng, i, args.prompt_min, args.prompt_max)
        t0 = time.perf_counter()
        ranks = await router.choose_replicas(router._replicas_list, request)
        router.on_request_routed(request, ranks[0][0].replica_id, None)  # type: ignore[arg-type]  # neither reads it
        times.append(time.perf_counter() - t0)
    times.sort()
    us = [t * 1e6 for t in times]
    by_cache = -1
    if isinstance(router, CacheAwareRouter):
        by_cache = sum(n for (_, by), n in router.stats.counts().routed.items() if by == "cache")
    return Cost(policy, len(us), statistics.fmean(us), us[len(us) // 2], us[int(0.99 * (len(us) - 1))], by_cache)


async def amain(args: argparse.Namespace) -> list[Cost]:
    config = RoutingConfig(policy="cache_aware", max_published_blocks=args.blocks)
    rng = random.Random(args.seed + 1)
    reports, first_s, steady_s = [], [], []
    for _ in range(args.replicas):
        reporter = Reporter(args.blocks, args.block_size)
        addresses = _addresses(rng, args.blocks, args.block_size)
        t0 = time.perf_counter()
        stats = reporter.report(CachedBlocks(tuple(addresses), 0, args.blocks), 0, 0).to_stats()
        first_s.append(time.perf_counter() - t0)
        # Later reports: each period's new blocks (a no-sharing prompt's worth) in, as many out.
        for _ in range(args.reports):
            addresses = addresses[args.churn :] + _addresses(rng, args.churn, args.block_size)
            t0 = time.perf_counter()
            reporter.report(CachedBlocks(tuple(addresses), 0, args.blocks), 0, 0).to_stats()
            steady_s.append(time.perf_counter() - t0)
        reports.append(stats)
    costs = []
    for policy in args.policies:
        kwargs: dict[str, Any] = dict(
            deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
        )
        router: RequestRouter
        if policy == "cache_aware":
            router = CacheAwareRouter(**kwargs)
            router.initialize_state(**config.model_dump(exclude={"policy"}))
        else:
            router = PowerOfTwoChoicesRequestRouter(**kwargs)
        replicas = [_Replica(f"r{i}", stats) for i, stats in enumerate(reports)]
        costs.append(await _time_router(router, policy, replicas, args))
    print(
        f"{args.replicas} replicas, {args.blocks}-block reports (block size {args.block_size}), "
        f"no-sharing prompts of {args.prompt_min}-{args.prompt_max} tokens, {args.decisions} decisions each"
    )
    print("| policy | µs per decision: mean | p50 | p99 | routed by cache |")
    print("|---|---|---|---|---|")
    for c in costs:
        cache = "-" if c.by_cache < 0 else str(c.by_cache)
        print(f"| {c.policy} | {c.us_mean:.0f} | {c.us_p50:.0f} | {c.us_p99:.0f} | {cache} |")
    print(
        f"a replica's report of {args.blocks} cached blocks (every routing.stats_period_s = "
        f"{config.stats_period_s} s): {statistics.fmean(first_s) * 1e3:.1f} ms with every block new, "
        f"then {statistics.median(steady_s) * 1e3:.1f} ms (median of {len(steady_s)}) with {args.churn} new"
    )
    return costs


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="logitpool bench routing --cost", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--blocks", type=int, default=RoutingConfig().max_published_blocks)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decisions", type=int, default=2000)
    p.add_argument("--churn", type=int, default=64, help="blocks cached and evicted between two reports")
    p.add_argument("--reports", type=int, default=10, help="later reports timed per replica")
    p.add_argument("--prompt-min", type=int, default=512)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument(
        "--policies", nargs="+", choices=("cache_aware", "power_of_two"), default=["cache_aware", "power_of_two"]
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(amain(parse(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

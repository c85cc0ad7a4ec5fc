"""`logitpool bench routing`: cache-aware routing against power of two and Ray Serve LLM's prefix tree.

Deploys the tiny model locally, once per (worker replicas, policy), fresh each time, and runs
three workloads over HTTP (streamed completions of token-id prompts, greedy, EOS ignored):

- tenants: `--tenants` system prompts of `--system-min`..`--system-max` tokens, `--requests`
  requests (a tenant's system prompt + a question of 16-48 tokens) in random order;
- chat: `--conversations` conversations of `--turns` turns, each turn's prompt the previous
  prompt + its answer + a new message, the turns of a conversation in sequence;
- control: `--control-requests` prompts sharing nothing (the throughput check).

Policies: `cache_aware` (cluster.routing), `power_of_two` (Serve's default) and `prefix_tree`:
Ray Serve LLM's own PrefixCacheAffinityRouter (its prefix tree actor, its defaults), fed each
prompt as text one character per token id, the only text this deployment's calls carry. A
single replica runs every workload first: the hit rate to match. Per run: the workers' prefix
hit rate and prefill tokens computed (their own counters), TTFT p50/p99, requests/s, the share
of requests the router sent by cache, and the bytes/s of cache reports the ingress's router took.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

from cluster.cli.bench_args import local_deployment
from cluster.routing.router import request_prompt
from worker.bench.latency import pct

POLICIES = ("cache_aware", "power_of_two", "prefix_tree")
WORKLOADS = ("tenants", "chat", "control")
LOW_TOKEN, HIGH_TOKEN = 10, 2900  # inside the tiny model's vocabulary, clear of special tokens


class PrefixTreeBaseline(PrefixCacheAffinityRouter):
    """Ray Serve LLM's PrefixCacheAffinityRouter with its own defaults; the prompt's text is its
    token ids, one character each (the worker's calls carry ids, not text)."""

    def initialize_state(self, **_routing: Any) -> None:  # type: ignore[override]  # our kwargs, not its own
        super().initialize_state()

    def _extract_text_from_request(self, pending_request: Any) -> str:
        prompt = request_prompt(pending_request)
        return None if prompt is None else "".join(map(chr, prompt))  # type: ignore[return-value]  # None: no text


BASELINE_CLASS = f"{__name__}:PrefixTreeBaseline"


# -- workloads -------------------------------------------------------------------------------


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW_TOKEN, HIGH_TOKEN) for _ in range(n)]


def question(rng: random.Random) -> list[int]:
    return ids(rng, rng.randint(16, 48))


@dataclass(frozen=True)
class Workloads:
    tenants: list[list[int]]
    chat: list[tuple[list[int], list[list[int]]]]  # (context, one message per turn)
    control: list[list[int]]


def workloads(args: argparse.Namespace) -> Workloads:
    rng = random.Random(args.seed)
    systems = [ids(rng, rng.randint(args.system_min, args.system_max)) for _ in range(args.tenants)]
    order = [i % args.tenants for i in range(args.requests)]
    rng.shuffle(order)
    chat = [
        (ids(rng, rng.randint(256, 512)), [question(rng) for _ in range(args.turns)]) for _ in range(args.conversations)
    ]
    control = [ids(rng, rng.randint(args.system_min, args.system_max)) for _ in range(args.control_requests)]
    return Workloads([systems[t] + question(rng) for t in order], chat, control)


# -- one request, one workload -----------------------------------------------------------------


@dataclass(frozen=True)
class Done:
    ttft_s: float
    output: list[int]


async def complete(client: httpx.AsyncClient, base: str, prompt: list[int], new_tokens: int) -> Done:
    body = {
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft, out = None, []
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            got = [t for c in chunk["choices"] for t in c.get("token_ids") or ()]
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            out += got
    if ttft is None:
        raise RuntimeError("no token came back")
    return Done(ttft, out)


async def run_prompts(
    client: httpx.AsyncClient, base: str, prompts: list[list[int]], args: argparse.Namespace
) -> list[Done]:
    gate = asyncio.Semaphore(args.concurrency)

    async def one(p: list[int]) -> Done:
        async with gate:
            return await complete(client, base, p, args.new_tokens)

    return await asyncio.gather(*(one(p) for p in prompts))


async def run_chat(
    client: httpx.AsyncClient, base: str, chats: list[tuple[list[int], list[list[int]]]], args: argparse.Namespace
) -> list[Done]:
    gate = asyncio.Semaphore(args.concurrency)

    async def conversation(context: list[int], messages: list[list[int]]) -> list[Done]:
        done, prompt = [], list(context)
        async with gate:
            for message in messages:
                prompt = prompt + message
                d = await complete(client, base, prompt, args.new_tokens)
                done.append(d)
                prompt = prompt + d.output
        return done

    return [d for ds in await asyncio.gather(*(conversation(c, m) for c, m in chats)) for d in ds]


# -- what the pool and the router say --------------------------------------------------------


async def prefix_counters(app: str, replicas: int, after: float) -> tuple[float, float]:
    """(tokens looked up, tokens found) in the replicas' prefix caches, from stats published after ``after``."""
    from cluster import pool_stats

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snaps = [s for s in await pool_stats.collect(app) if s.time > after]
        if len(snaps) >= replicas:
            return (
                sum(s.kv["prefix_query_tokens"] for s in snaps),
                sum(s.kv["prefix_hit_tokens"] for s in snaps),
            )
        await asyncio.sleep(0.3)
    raise RuntimeError(f"{app}: the worker replicas published no fresh stats")


@dataclass(frozen=True)
class RouterView:
    by_cache: int
    by_load: int
    report_bytes: int
    replicas_reporting: int


async def router_view(client: httpx.AsyncClient, base: str) -> RouterView:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(f"{base}/metrics")).text
    by = {"cache": 0, "load": 0}
    report_bytes, reporting = 0, set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "logitpool_routing_requests_total":
                by[s.labels["by"]] += int(s.value)
            elif s.name == "logitpool_routing_report_bytes_total":
                report_bytes += int(s.value)
            elif s.name == "logitpool_routing_index_blocks" and s.labels["source"] == "reported":
                reporting.add(s.labels["replica"])
    return RouterView(by["cache"], by["load"], report_bytes, len(reporting))


@dataclass(frozen=True)
class Row:
    replicas: int
    policy: str
    workload: str
    requests: int
    hit_rate: float
    prefill_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    req_s: float
    by_cache: float | None  # share of requests routed by cache (cache_aware only)
    report_bytes_s: float | None


async def run_one(
    args: argparse.Namespace, work: Workloads, replicas: int, policy: str, base: str, app: str
) -> list[Row]:
    rows = []
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=1200, limits=limits) as client:
        rng = random.Random(-1)
        await run_prompts(client, base, [ids(rng, 32) for _ in range(2 * replicas)], args)  # warm every replica
        if policy == "cache_aware":
            deadline = time.monotonic() + 60
            while (await router_view(client, base)).replicas_reporting < replicas and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
        for name in args.workloads:
            t0 = time.time()
            q0, h0 = await prefix_counters(app, replicas, t0)
            v0 = await router_view(client, base)
            start = time.perf_counter()
            if name == "chat":
                done = await run_chat(client, base, work.chat, args)
            else:
                done = await run_prompts(client, base, getattr(work, name), args)
            wall = time.perf_counter() - start
            q1, h1 = await prefix_counters(app, replicas, time.time())
            v1 = await router_view(client, base)
            routed = (v1.by_cache - v0.by_cache) + (v1.by_load - v0.by_load)
            ttft = [d.ttft_s for d in done]
            rows.append(
                Row(
                    replicas,
                    policy,
                    name,
                    len(done),
                    (h1 - h0) / max(q1 - q0, 1.0),
                    int((q1 - q0) - (h1 - h0)),
                    1e3 * pct(ttft, 0.5),
                    1e3 * pct(ttft, 0.99),
                    len(done) / wall,
                    (v1.by_cache - v0.by_cache) / routed if policy == "cache_aware" and routed else None,
                    (v1.report_bytes - v0.report_bytes) / (time.time() - t0) if policy == "cache_aware" else None,
                )
            )
            print(fmt(rows[-1], None, None), flush=True)
    return rows


def fmt(r: Row, single: Row | None, pow2: Row | None) -> str:
    vs1 = f"{r.hit_rate / single.hit_rate:.2f}" if single and single.hit_rate else "-"
    vs2 = f"{r.prefill_tokens / pow2.prefill_tokens:.2f}" if pow2 and pow2.prefill_tokens else "-"
    tput = f"{r.req_s / pow2.req_s:.2f}" if pow2 and pow2.req_s else "-"
    by_cache = "-" if r.by_cache is None else f"{100 * r.by_cache:.0f}%"
    bps = "-" if r.report_bytes_s is None else f"{r.report_bytes_s / 1024:.1f} KiB/s"
    return (
        f"| {r.replicas} | {r.policy} | {r.workload} | {r.requests} | {100 * r.hit_rate:.1f}% | {vs1} "
        f"| {r.prefill_tokens} | {vs2} | {r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f} | {r.req_s:.2f} | {tput} "
        f"| {by_cache} | {bps} |"
    )


def table(rows: Sequence[Row]) -> list[str]:
    """Every row beside the single replica's (hit rate) and power of two's (prefill, throughput)."""
    single = {r.workload: r for r in rows if r.replicas == 1}
    pow2 = {(r.replicas, r.workload): r for r in rows if r.policy == "power_of_two" and r.replicas > 1}
    out = [
        "| replicas | policy | workload | requests | hit rate | vs 1 replica | prefill tokens | vs power_of_two "
        "| TTFT p50 / p99 ms | req/s | vs power_of_two | by cache | reports in |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ordered = sorted(rows, key=lambda r: (WORKLOADS.index(r.workload), r.replicas, POLICIES.index(r.policy)))
    return out + [fmt(r, single.get(r.workload), pow2.get((r.replicas, r.workload))) for r in ordered]


async def amain(args: argparse.Namespace) -> None:
    from ray import serve

    from cluster.cli.launch import deploy, start_serve
    from cluster.config import LogitpoolConfig
    from worker.model.loader import embedded_model_path

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    model = args.model or str(embedded_model_path())
    work = workloads(args)
    runs = [(1, "power_of_two")] + [(n, p) for n in args.replicas for p in args.policies]
    rows: list[Row] = []
    started = False
    base = f"http://127.0.0.1:{args.http_port}"
    print(
        f"tenants {args.tenants} x {args.system_min}-{args.system_max} tokens, {args.requests} requests; chat "
        f"{args.conversations} x {args.turns} turns; control {args.control_requests}; {args.new_tokens} new tokens, "
        f"{args.concurrency} in flight\n",
        flush=True,
    )
    for replicas, policy in runs:
        app = f"bench-routing-{replicas}-{policy.replace('_', '-')}"
        cfg = LogitpoolConfig.model_validate(
            {
                "engine": {"model": model, "max_num_seqs": args.max_num_seqs},
                "workers": {"num_replicas": replicas, "num_cpus": args.worker_cpus},
                "server": {"http_port": args.http_port, "grpc_port": args.grpc_port},
                "routing": {"policy": "power_of_two" if policy == "power_of_two" else "cache_aware"},
                "app_name": app,
            }
        )
        build: dict[str, Any] = {"router_class": BASELINE_CLASS} if policy == "prefix_tree" else {}
        if not started:
            await asyncio.to_thread(start_serve, cfg)
            started = True
        else:
            await asyncio.to_thread(functools.partial(deploy, cfg, **build))
        try:
            rows += await run_one(args, work, replicas, policy, base, app)
        finally:
            await asyncio.to_thread(serve.delete, app)
    print()
    print("\n".join(table(rows)))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cost" in argv:  # routing's own cost per request, in-process (cluster.cli.bench_routing_cost)
        from cluster.cli.bench_routing_cost import main as cost_main

        return cost_main([a for a in argv if a != "--cost"])
    p = argparse.ArgumentParser(prog="logitpool bench routing", description="cache-aware routing vs the baselines")
    p.add_argument("--cost", action="store_true", help="measure routing's own cost per request instead (no replicas)")
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--system-min", type=int, default=512)
    p.add_argument("--system-max", type=int, default=1024)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--control-requests", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    local_deployment(p, worker_cpus=1.0)
    asyncio.run(amain(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Cache-aware routing for real: two worker replicas behind the ingress (Serve's router running
cluster.routing.router.CacheAwareRouter).

A conversation's second turn and a tenant's second request must find their prefix cached (each
response's `usage.prompt_tokens_details.cached_tokens`), which by chance (power of two) happens
about half the time per request; then one replica is killed and every request still succeeds,
the dead replica's index gone from the router."""

from __future__ import annotations

import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import pool_stats
from tests.cluster.serving_helpers import deployed, post

pytestmark = pytest.mark.ray

APP = "logitpool-routing"
BLOCK = 16


@pytest.fixture(scope="module")
def serving(serve_ports, tiny_model_dir):
    yield from deployed(
        serve_ports,
        tiny_model_dir,
        APP,
        {"max_num_seqs": 8, "block_size": BLOCK},
        workers={"num_replicas": 2, "num_cpus": 1},
        routing={"policy": "cache_aware", "stats_period_s": 0.5},
    )


def base(cfg) -> str:
    return f"http://127.0.0.1:{cfg.server.http_port}"


def complete(cfg, prompt: list[int], n: int = 8) -> tuple[list[int], int]:
    """The completion's token ids and its ``usage.prompt_tokens_details.cached_tokens`` (the
    prompt tokens the serving replica found in its prefix cache: OpenAI's field, vLLM fills it too)."""
    r = post(
        base(cfg),
        {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def snapshots(after: float) -> dict[str, pool_stats.PoolSnapshot]:
    """Every replica's engine stats published after ``after`` (wall clock), waited for (bounded)."""
    import asyncio

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snaps = asyncio.run(pool_stats.collect(APP))
        fresh = {s.replica_id: s for s in snaps if s.time > after and s.alive}
        if len(fresh) == len(snaps) >= 2:
            return fresh
        time.sleep(0.3)
    raise AssertionError("worker replicas did not publish fresh stats")


def routing_metrics(cfg) -> dict[str, list]:
    text = httpx.get(base(cfg) + "/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text) if f.name.startswith("logitpool_routing")}


def routed_by_cache(cfg) -> int:
    samples = routing_metrics(cfg)["logitpool_routing_requests"]
    return int(sum(s.value for s in samples if s.labels["by"] == "cache" and s.name.endswith("_total")))


def index_blocks(cfg) -> dict[tuple[str, str], int]:
    """(replica, reported | guessed) -> blocks in the ingress router's index."""
    samples = routing_metrics(cfg).get("logitpool_routing_index_blocks", [])
    return {(s.labels["replica"], s.labels["source"]): int(s.value) for s in samples}


def reported_replicas(cfg) -> set[str]:
    return {replica for replica, source in index_blocks(cfg) if source == "reported"}


def guessed_blocks(cfg) -> int:
    return sum(n for (_, source), n in index_blocks(cfg).items() if source == "guessed")


def wait_for(cond, what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 2900) for _ in range(n)]


def test_second_turns_and_second_requests_are_served_from_cache_and_a_killed_replica_is_routed_around(serving):
    import ray

    rng = random.Random(16)
    complete(serving, tokens(rng, 20))  # the ingress's router starts with its first call
    wait_for(lambda: len(reported_replicas(serving)) == 2, "both replicas must report to the router")
    # A batch: one `generate` call per prompt, all with the ingress request's id in Serve.
    batch = post(base(serving), {"prompt": [tokens(rng, 40) for _ in range(4)], "max_tokens": 2, "n": 2})
    assert batch.status_code == 200 and len(batch.json()["choices"]) == 8, batch.text[:300]

    # Conversations: each second turn follows its first at once (routed by the first's guess, or
    # by a report if one came in between: it confirms the guess).
    start_cache = routed_by_cache(serving)
    for _ in range(6):
        turn1 = tokens(rng, 200)
        out, _ = complete(serving, turn1)
        _, cached = complete(serving, turn1 + out + tokens(rng, 30))
        assert cached >= (len(turn1) + len(out) - 1) // BLOCK * BLOCK, cached

    # Tenants: a second request sent once the replicas' reports hold every first request's
    # blocks (a report holding a guessed block takes the guess back) finds them by the reports.
    prompts = [tokens(rng, 300) for _ in range(6)]
    for system in prompts:
        complete(serving, system + tokens(rng, 20))
    wait_for(lambda: guessed_blocks(serving) == 0, "the reports must confirm every guess")
    for system in prompts:
        _, cached = complete(serving, system + tokens(rng, 20))
        assert cached >= 300 // BLOCK * BLOCK, cached
    # /metrics serves what each ingress replica last published (cluster.metrics.shared): wait for it.
    wait_for(lambda: routed_by_cache(serving) - start_cache >= 6 + len(prompts), "routed by cache: too few")

    # Kill the replica that served more from its cache; every tenant still gets answers.
    snaps = snapshots(time.time())
    victim = max(snaps.values(), key=lambda s: s.kv["prefix_hit_tokens"]).replica_id
    (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    for system in prompts:
        complete(serving, system + tokens(rng, 20))
    wait_for(lambda: victim not in reported_replicas(serving), "the dead replica's index must go")
    for system in prompts:
        complete(serving, system + tokens(rng, 20))

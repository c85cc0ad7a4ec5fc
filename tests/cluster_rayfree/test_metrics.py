"""/metrics on the fake engine: the request histograms move as requests complete (over HTTP and
gRPC), vLLM's names, labels and buckets appear under the `metrics.names` switch and not without
it, the worker pool's vLLM gauges, and several ingress replicas' published snapshots served the
same by whichever replica a scrape reaches. Parsed with prometheus_client's own text parser."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster.config import LogitpoolConfig
from cluster.frontend import Frontend
from cluster.metrics import IngressSnapshot, Metrics
from cluster.pool_stats import PoolSnapshot
from cluster.rpc.service import GrpcAdapter
from tests.cluster_rayfree.fake_engine import FakeEngine
from tests.cluster_rayfree.test_frontend_local import _ctx, cfg, events, fe, http, worker
from worker.outputs import CompletionOutput, RequestOutput

__all__ = ["cfg", "fe", "worker"]  # fixtures, shared with test_frontend_local

# vLLM v1's bucket bounds, copied from vllm/v1/metrics/loggers.py (PrometheusStatLogger): the
# reference a vLLM dashboard's histogram_quantile was written against.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
             40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
VLLM_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0]  # fmt: skip
VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": VLLM_TTFT,
    "vllm:inter_token_latency_seconds": VLLM_TOKEN,
    "vllm:time_per_output_token_seconds": VLLM_TOKEN,
    "vllm:request_time_per_output_token_seconds": VLLM_TOKEN,
    "vllm:e2e_request_latency_seconds": VLLM_REQUEST,
    "vllm:request_queue_time_seconds": VLLM_REQUEST,
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def scrape(fe: Frontend) -> Samples:
    r = http(fe, "GET", "/metrics")
    assert r.status_code == 200
    return parse(r.text)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def grpc_generate(fe: Frontend, prompt: list[int], max_tokens: int) -> pb.GenerateResponse:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), params=pb.SamplingParams(max_tokens=max_tokens))
    return asyncio.run(GrpcAdapter(fe).generate(req, _ctx()))


def test_request_histograms_move_as_requests_complete(fe: Frontend) -> None:
    before = scrape(fe)
    # Four sequences: two prompts of one completion (3 tokens each), a streamed chat (2), gRPC (4).
    r = http(fe, "POST", "/v1/completions", {"prompt": [[5, 6], [7, 8, 9]], "max_tokens": 3})
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    assert events(http(fe, "POST", "/v1/chat/completions", chat))[-1] == "[DONE]"
    grpc_generate(fe, [4, 4, 4, 4], 4)
    after = scrape(fe)
    prompts = [p for _, p, _ in FakeEngine.seen]
    assert len(prompts) == 4
    gen = [3, 3, 2, 4]
    model = {"model_name": fe.model_name}
    for prefix in ("logitpool_", "vllm:"):
        for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
            assert moved(before, after, f"{prefix}{name}_count", **model) == 4, name
            assert moved(before, after, f"{prefix}{name}_sum", **model) > 0, name
        # The worker's queue time arrives with each sequence's last output, as reported.
        assert moved(before, after, f"{prefix}request_queue_time_seconds_sum") == pytest.approx(4 * 0.125)
        # One delta per token (stream interval 0): a gap for every token after a sequence's first.
        assert moved(before, after, f"{prefix}inter_token_latency_seconds_count") == sum(g - 1 for g in gen)
        assert moved(before, after, f"{prefix}request_time_per_output_token_seconds_count") == 4
        assert moved(before, after, f"{prefix}request_prompt_tokens_sum") == sum(map(len, prompts))
        assert moved(before, after, f"{prefix}request_generation_tokens_sum") == sum(gen)
        assert moved(before, after, f"{prefix}request_generation_tokens_count") == 4
        assert moved(before, after, f"{prefix}prompt_tokens_total") == sum(map(len, prompts))
    assert moved(before, after, "vllm:time_per_output_token_seconds_count") == sum(g - 1 for g in gen)
    assert moved(before, after, "vllm:generation_tokens_total") == sum(gen)
    assert moved(before, after, "vllm:request_success_total", finished_reason="length") == 4
    assert moved(before, after, "logitpool_requests_total", protocol="http", status="200") == 2
    assert moved(before, after, "logitpool_requests_total", protocol="grpc", status="OK") == 1
    # A histogram's buckets are cumulative and its +Inf bucket is its count.
    ttft = sorted(
        (float(dict(lab)["le"]), v) for (n, lab), v in after.items() if n == "vllm:time_to_first_token_seconds_bucket"
    )
    assert [v for _, v in ttft] == sorted(v for _, v in ttft)
    assert ttft[-1] == (float("inf"), total(after, "vllm:time_to_first_token_seconds_count"))


def test_vllm_names_labels_and_buckets(fe: Frontend) -> None:
    http(fe, "POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    families = {f.name: f for f in text_string_to_metric_families(http(fe, "GET", "/metrics").text)}
    for name, bounds in VLLM_HISTOGRAMS.items():
        fam = families[name]
        assert fam.type == "histogram"
        les = sorted({float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")})
        assert les == [*bounds, float("inf")], name
        assert {s.labels["model_name"] for s in fam.samples} == {fe.model_name}
    # Token counts: vLLM's 1-2-5 buckets up to the context length.
    les = sorted({float(s.labels["le"]) for s in families["vllm:request_prompt_tokens"].samples if "le" in s.labels})
    assert les[:6] == [1, 2, 5, 10, 20, 50] and les[-2] <= fe.max_model_len < les[-2] * 2.5
    for counter in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
        assert families[counter].type == "counter"
    assert {s.labels["finished_reason"] for s in families["vllm:request_success"].samples} >= {"length"}


@pytest.fixture
def frontend_named(cfg: LogitpoolConfig, worker: Any) -> Iterator[Any]:
    async def pool() -> list[PoolSnapshot]:
        return [await worker.stats.remote()]

    def make(names: str) -> Frontend:
        return Frontend(cfg.with_overrides(**{"metrics.names": names}), worker, pool=pool)

    FakeEngine.seen = []
    yield make


@pytest.mark.parametrize("names", ["logitpool", "vllm", "both"])
def test_the_names_switch(frontend_named: Any, names: str) -> None:
    fe = frontend_named(names)
    assert http(fe, "POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}).status_code == 200
    text = http(fe, "GET", "/metrics").text
    seen = {f.name for f in text_string_to_metric_families(text)}
    vllm = {n for n in seen if n.startswith("vllm:")}
    twins = {"logitpool_time_to_first_token_seconds", "logitpool_e2e_request_latency_seconds"}
    assert (vllm != set()) == (names != "logitpool")
    assert {"vllm:time_to_first_token_seconds", "vllm:num_requests_running"} <= vllm or names == "logitpool"
    assert (twins <= seen) == (names != "vllm") and (twins & seen == set()) == (names == "vllm")
    # logitpool's own diagnostics have no vLLM twin: always there.
    assert {"logitpool_requests", "logitpool_worker_replicas", "logitpool_kv_cache"} <= seen


def test_pool_gauges_under_vllm_names_per_worker_replica() -> None:
    kv = {"blocks_used": 30.0, "blocks_total": 120.0, "prefix_query_tokens": 400.0, "prefix_hit_tokens": 96.0}
    pool = [
        PoolSnapshot(True, 0.1, 3, 2, replica_id="a", kv={**kv, "num_preemptions": 5.0}),
        PoolSnapshot(True, 0.1, 1, 0, replica_id="b", kv={}),  # an engine with no KV manager
    ]
    samples = parse(Metrics(model_name="m", max_model_len=64).render(pool)[0].decode())
    a, b = {"model_name": "m", "engine": "a"}, {"model_name": "m", "engine": "b"}
    assert total(samples, "vllm:num_requests_running", **a) == 3
    assert total(samples, "vllm:num_requests_running", **b) == 1
    assert total(samples, "vllm:num_requests_waiting", **a) == 2
    assert total(samples, "vllm:kv_cache_usage_perc", **a) == 0.25
    assert total(samples, "vllm:prefix_cache_queries_total", **a) == 400
    assert total(samples, "vllm:prefix_cache_hits_total", **a) == 96
    assert total(samples, "vllm:num_preemptions_total", **a) == 5
    assert not [k for k in samples if k[0] == "vllm:kv_cache_usage_perc" and ("engine", "b") in k[1]]


def finished_delta(tokens: int) -> RequestOutput:
    out = CompletionOutput(0, "x" * tokens, list(range(tokens)), None, None, "stop", queue_time_s=0.5)
    return RequestOutput("r", None, [], [out], True)


def test_every_ingress_replica_answers_for_all_of_them() -> None:
    """Two ingress replicas, each with its own requests: a scrape that reaches either gets both
    replicas' series, labelled by replica, with the same values."""
    a, b = (Metrics(model_name="m", max_model_len=64, replica=r) for r in ("a", "b"))
    for m, n in ((a, 1), (b, 3)):
        for _ in range(n):
            clock = m.clock(prompt_tokens=7, n=1)
            clock.add(finished_delta(2))
            clock.close()
        m.request("http", 200)
    published = [IngressSnapshot.from_json(m.snapshot().to_json(), replica_id=m.replica) for m in (a, b)]
    on_a, on_b = (parse(m.render((), published)[0].decode()) for m in (a, b))
    assert on_a == on_b
    for replica, n in (("a", 1), ("b", 3)):
        assert total(on_a, "vllm:e2e_request_latency_seconds_count", ingress=replica) == n
        assert total(on_a, "vllm:request_queue_time_seconds_sum", ingress=replica) == 0.5 * n
        assert total(on_a, "logitpool_requests_total", ingress=replica) == 1
    assert total(on_a, "vllm:e2e_request_latency_seconds_count") == 4  # what sum() over replicas gives
    # Before it has published, a replica serves its own live series beside the others'.
    alone = parse(a.render((), published[1:])[0].decode())
    assert total(alone, "vllm:e2e_request_latency_seconds_count", ingress="a") == 1
    assert total(alone, "vllm:e2e_request_latency_seconds_count", ingress="b") == 3
    with pytest.raises(ValueError):
        IngressSnapshot.from_json('{"families": "no"}')


def test_a_stream_cut_off_counts_its_sequences_as_aborted() -> None:
    m = Metrics(model_name="m", max_model_len=64)
    started = m.clock(prompt_tokens=3, n=2)
    started.add(RequestOutput("r", None, [], [CompletionOutput(0, "x", [1], None, None)], False))
    started.close()
    m.clock(prompt_tokens=3, n=2).close()  # rejected before anything arrived: counted nowhere
    samples = parse(m.render()[0].decode())
    assert total(samples, "vllm:request_success_total", finished_reason="abort") == 2
    assert total(samples, "vllm:time_to_first_token_seconds_count") == 1
    assert total(samples, "vllm:e2e_request_latency_seconds_count") == 0

"""The serving cluster for real: Ray Serve, the OpenAI SDK over HTTP, the client library over
gRPC, scaling, replica death and load. One Serve application for the module (on the session's
Ray cluster); tests run in file order because scaling and killing change the deployment."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import httpx
import openai
import pytest

from client import AsyncClient, Client, InvalidArgument, Unavailable
from cluster import pool_stats
from cluster.config import LogitpoolConfig
from cluster.metrics import shared
from tests.worker.test_engine import DUMMY_FQCN

pytestmark = pytest.mark.ray

APP = "logitpool"
MODEL = "tiny"  # the served model name requests must use
TARGET = 67


def config(model_dir, http_port: int, grpc_port: int, **workers) -> LogitpoolConfig:
    return LogitpoolConfig.model_validate(
        {
            "engine": {
                "model": str(model_dir),
                "max_num_seqs": 32,
                "max_model_len": 2048,
                "logits_processors": [DUMMY_FQCN],
            },
            "workers": {"num_replicas": 1, "num_cpus": 1, **workers},
            "server": {"http_port": http_port, "grpc_port": grpc_port},
            "app_name": APP,
            "served_model_name": MODEL,
        }
    )


@pytest.fixture(scope="module")
def serving(serve_ports, tiny_model_dir):
    from cluster.cli.launch import wait_ready
    from tests.cluster.serving_helpers import deploy

    # Autoscaling between 1 and 2 worker replicas with short delays: light tests run on one
    # replica, the load test grows the pool to two, which then stay (long downscale delay).
    cfg = config(
        tiny_model_dir,
        *serve_ports,
        num_replicas=None,
        autoscaling={
            "min_replicas": 1,
            "max_replicas": 2,
            "target_ongoing_requests": 2,
            "upscale_delay_s": 0.5,
            "downscale_delay_s": 3600,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2,
        },
    )
    deploy(cfg)
    wait_ready("127.0.0.1", cfg.server.http_port, timeout_s=180)
    yield cfg
    from ray import serve

    serve.delete(APP)


def worker_handle():
    from ray import serve

    return serve.get_deployment_handle("LogitpoolWorker", app_name=APP)


def worker_infos(samples: int = 12) -> dict[str, dict]:
    """Info of every worker replica reachable through the router (sampled)."""
    h = worker_handle()
    infos = {}
    for _ in range(samples):
        info = h.info.remote().result(timeout_s=30)
        infos[info["replica_id"]] = info
    return infos


def greedy(prompt, n=8, **kw):
    return {"prompt": prompt, "max_tokens": n, "temperature": 0.0, **kw}


# -- HTTP through the official openai SDK ---------------------------------------------------


def test_openai_completions(oai):
    r = oai.completions.create(model=MODEL, **greedy("def main(", 8), extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    again = oai.completions.create(model=MODEL, **greedy("def main(", 8), extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text
    stream = oai.completions.create(model=MODEL, **greedy("def main(", 8), stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text


def test_openai_chat(oai):
    msgs = [{"role": "user", "content": "hello there"}]
    r = oai.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    stream = oai.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content


def test_openai_logprobs_seed_stop_bias(oai):
    r = oai.completions.create(
        model=MODEL,
        prompt="import os",
        max_tokens=6,
        temperature=1.0,
        seed=11,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 and len(lp.token_logprobs) == 6
    assert all(len(t) in (3, 4) for t in lp.top_logprobs)
    same = oai.completions.create(
        model=MODEL, prompt="import os", max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    assert same.choices[0].text == r.choices[0].text
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert len(chat.choices[0].logprobs.content) == 4
    assert all(len(c.top_logprobs) == 2 for c in chat.choices[0].logprobs.content)
    free = oai.completions.create(model=MODEL, **greedy("class Foo", 12), extra_body={"ignore_eos": True}).choices[0]
    stop = free.text[2:5]
    cut = oai.completions.create(model=MODEL, **greedy("class Foo", 12), stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == free.text[: free.text.index(stop)]
    biased = oai.completions.create(
        model=MODEL,
        **greedy("class Foo", 5),
        logit_bias={str(TARGET): 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert (
        biased.choices[0].text
        == oai.completions.create(
            model=MODEL,
            **greedy("class Foo", 5),
            extra_body={"ignore_eos": True, "vllm_xargs": {"target_token": TARGET}},
        )
        .choices[0]
        .text
    )


def test_openai_vllm_xargs_drive_the_custom_processor(oai, grpc_client):
    r = oai.completions.create(
        model=MODEL,
        prompt="hello",
        max_tokens=7,
        temperature=0.9,
        extra_body={"vllm_xargs": {"target_token": TARGET}, "ignore_eos": True},
    )
    ids = grpc_client.generate(
        "hello", max_tokens=7, temperature=0.9, ignore_eos=True, extra_args={"target_token": TARGET}
    ).token_ids
    assert list(ids) == [TARGET] * 7
    assert (
        r.choices[0].text
        == grpc_client.generate("hello", max_tokens=7, ignore_eos=True, extra_args={"target_token": TARGET}).text
    )
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(
            model=MODEL, prompt="hello", max_tokens=4, extra_body={"vllm_xargs": {"target_token": "abc"}}
        )
    assert "target_token value abc is not int" in str(err.value)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=5.0)


def test_http_endpoints(serving):
    base = f"http://127.0.0.1:{serving.server.http_port}"
    assert httpx.get(f"{base}/health").status_code == 200
    listing = httpx.get(f"{base}/v1/processors").json()
    procs = {p["fqcn"]: p for p in listing["data"]}
    assert procs[DUMMY_FQCN]["extra_args_keys"] is None  # declares nothing: strict keys are off
    assert listing["strict_extra_args"] is False
    top_a = procs["worker.logits_processor.library.top_a:TopALogitsProcessor"]
    assert top_a["argmax_invariant"] and top_a["extra_args_schema"]["properties"]["top_a"]["maximum"] == 1.0
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["object"] == "model"
    metrics = httpx.get(f"{base}/metrics").text
    assert "logitpool_requests_total" in metrics
    bad = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and "body" in bad.json()["error"]["message"]
    bad = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "top_p": 0})
    assert bad.status_code == 400 and "top_p" in bad.json()["error"]["message"]


def test_request_ids_and_latency_histograms(serving):
    """Through Serve's proxy: a sane x-request-id comes back as sent, an insane one is replaced;
    the request histograms move, under vLLM's names too, from the ingress's published snapshot."""
    from prometheus_client.parser import text_string_to_metric_families

    base = f"http://127.0.0.1:{serving.server.http_port}"
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, headers={"x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["trace-42"]
    r = httpx.post(f"{base}/v1/completions", json=body, headers={"x-request-id": "x" * 500})
    (fresh,) = r.headers.get_list("x-request-id")
    uuid.UUID(fresh)
    deadline = time.monotonic() + 60  # the ingress publishes from its health check (every 10 s)
    while True:
        published = asyncio.run(pool_stats.collect_published(APP, shared.KIND, shared.IngressSnapshot.from_json))
        samples = [s for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text) for s in f.samples]
        e2e = [s for s in samples if s.name == "vllm:e2e_request_latency_seconds_count"]
        if published and sum(s.value for s in e2e) >= 2:
            break
        assert time.monotonic() < deadline, "no published ingress metrics"
        time.sleep(0.5)
    assert {s.labels["ingress"] for s in e2e} <= {p.replica_id for p in published}
    assert {s.labels["model_name"] for s in e2e} == {MODEL}
    ttft = sum(s.value for s in samples if s.name == "logitpool_time_to_first_token_seconds_count")
    assert ttft >= 2 and any(s.name == "vllm:num_requests_running" for s in samples)


# -- gRPC through the client library ---------------------------------------------------------


def chunks_usage_prompt(c: Client) -> int:
    """prompt_tokens of the usage that arrives on a stream's last chunk."""
    usages = [ch.usage for ch in c.stream("def f(", max_tokens=3, ignore_eos=True) if ch.usage is not None]
    assert len(usages) == 1 and usages[0].completion_tokens == 3
    return usages[0].prompt_tokens


def test_grpc_generate_stream_and_errors(grpc_client):
    c = grpc_client.generate("def f(", max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    assert len(c.token_ids) == 6 and c.finish_reason == "length"
    assert c.usage.completion_tokens == 6 and c.usage.prompt_tokens > 0
    assert chunks_usage_prompt(grpc_client) > 0
    assert len(c.logprobs) == 6 and all(p.rank >= 1 for p in c.logprobs)
    chunks = list(grpc_client.stream("def f(", max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [t for ch in chunks for t in ch.token_ids] == list(c.token_ids)
    assert "".join(ch.text for ch in chunks) == c.text
    with pytest.raises(InvalidArgument, match="target_token"):
        grpc_client.generate("x", extra_args={"target_token": 1.5})
    with pytest.raises(InvalidArgument, match="min_p"):
        grpc_client.generate("x", min_p=2.0)
    infos = grpc_client.processors()
    assert DUMMY_FQCN in [p.fqcn for p in infos]
    assert grpc_client.health()


def test_a_client_request_id_is_for_tracing_only(grpc_client):
    """Two concurrent calls with the same request_id both run; the id comes back on each."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        futs = [
            ex.submit(grpc_client.generate, "x", max_tokens=30, ignore_eos=True, request_id="dup") for _ in range(2)
        ]
        results = [f.result(timeout=60) for f in futs]
    assert [r.request_id for r in results] == ["dup", "dup"]
    assert all(len(r.token_ids) == 30 for r in results)


def test_streams_coalesce_deltas_but_not_the_first_token(grpc_client):
    """A worker sends the first token at once, then merged deltas (workers.stream_interval_s)."""
    chunks = list(grpc_client.stream("def f(", max_tokens=200, temperature=0.0, ignore_eos=True))
    assert len(chunks[0].token_ids) == 1
    assert sum(len(c.token_ids) for c in chunks) == 200
    assert len(chunks) <= 100, "deltas must be merged (a 200-token stream is not 200 messages)"


def test_validation_happens_at_the_ingress(grpc_client, oai):
    before = sum(i["num_requests"] for i in worker_infos().values())
    for _ in range(3):
        with pytest.raises(InvalidArgument):
            grpc_client.generate("x", extra_args={"target_token": "abc"})
        with pytest.raises(openai.BadRequestError):
            oai.completions.create(model=MODEL, prompt="x", extra_body={"vllm_xargs": {"target_token": [1]}})
    after = sum(i["num_requests"] for i in worker_infos().values())
    assert after == before, "a rejected request must never reach a worker"
    grpc_client.generate("x", max_tokens=2)
    assert sum(i["num_requests"] for i in worker_infos().values()) == before + 1


def test_cancelled_stream_frees_its_row(grpc_client):
    stream = grpc_client.stream("while True:", max_tokens=400, ignore_eos=True)
    it = iter(stream)
    next(it)
    next(it)
    running = max(i["num_running"] for i in worker_infos().values())
    assert running >= 1
    stream.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and max(i["num_running"] for i in worker_infos(4).values()) > 0:
        time.sleep(0.1)
    assert max(i["num_running"] for i in worker_infos().values()) == 0


# -- scaling, faults, load --------------------------------------------------------------------


def _load(target: str, stop: threading.Event, errors: list) -> None:
    with Client(target, timeout=60) as c:
        while not stop.is_set():
            try:
                c.generate("load", max_tokens=16, ignore_eos=True)
            except Exception as exc:  # noqa: BLE001 - collected, asserted by the test
                errors.append(exc)


def test_scale_worker_deployment_under_load(serving):
    """Load grows the worker deployment from 1 to 2 replicas (Serve autoscaling); both serve."""
    assert len(worker_infos(8)) == 1
    target = f"127.0.0.1:{serving.server.grpc_port}"
    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=_load, args=(target, stop, errors)) for _ in range(8)]
    for t in threads:
        t.start()
    # Serve's router only reaches an idle replica when the others are busy, so replicas are
    # observed while the load runs.
    seen: dict[str, dict] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            seen.update(worker_infos(8))
            if len(seen) == 2 and all(i["num_requests"] > 0 for i in seen.values()):
                break
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert len(seen) == 2 and all(i["num_requests"] > 0 for i in seen.values()), seen
    assert not errors, errors[:3]


def test_sixty_four_streams_across_two_replicas(serving, tiny_model_dir):
    from worker import LLM, SamplingParams

    prompts = ["def a(", "import b", "class C:", "x = 1"]
    ref = LLM(str(tiny_model_dir), max_num_seqs=4, load_entry_points=False).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )
    want = {p: r.outputs[0].token_ids for p, r in zip(prompts, ref)}

    async def main():
        async with AsyncClient(f"127.0.0.1:{serving.server.grpc_port}", timeout=120) as c:

            async def one(i):
                p = prompts[i % 4]
                ids = []
                async for ch in c.stream(p, max_tokens=10, temperature=0.0, ignore_eos=True):
                    ids += ch.token_ids
                return p, ids

            return await asyncio.gather(*(one(i) for i in range(64)))

    busy: set[str] = set()
    done = threading.Event()

    def watch():
        while not done.is_set():
            busy.update(rid for rid, i in worker_infos(4).items() if i["num_running"] > 0)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(main())
    finally:
        done.set()
        watcher.join(30)
    assert len(results) == 64
    for p, ids in results:
        assert ids == want[p]
    assert len(busy) == 2, "both replicas must have run streams"


# Every call's bound in the kill test: the survivors then decode 4 x 1,900 tokens on one replica,
# which takes well over a minute on a loaded 2-core machine; "no request hangs" is this bound.
BOUND_S = 300


def test_killed_replica_fails_fast_and_later_requests_succeed(serving):
    import ray

    target = f"127.0.0.1:{serving.server.grpc_port}"
    base = f"http://127.0.0.1:{serving.server.http_port}"
    outcomes: list[tuple[str, object, float]] = []

    def grpc_stream():
        with Client(target, timeout=BOUND_S, max_retries=0) as c:
            try:
                for _ in c.stream("forever", max_tokens=1900, ignore_eos=True):
                    pass
                outcomes.append(("grpc", "completed", time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - collected, asserted by the test
                outcomes.append(("grpc", exc, time.monotonic()))

    def http_call():
        try:
            r = httpx.post(
                f"{base}/v1/completions",
                json={"prompt": "forever", "max_tokens": 1900, "ignore_eos": True},
                timeout=BOUND_S,
            )
            outcomes.append(("http", r.status_code, time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - collected, asserted by the test
            outcomes.append(("http", exc, time.monotonic()))

    threads = [threading.Thread(target=f) for f in (grpc_stream, http_call) * 3]
    started = time.time()
    for t in threads:
        t.start()
    # Kill once every stream is on a replica (each needs seconds to finish 1,900 tokens). Each
    # replica's load is read from what it publishes, not sampled through a handle: the router
    # sends those calls to the less loaded replica, which may hold none of the streams.
    deadline = time.monotonic() + 30
    on: dict[str, int] = {}
    while time.monotonic() < deadline:
        snaps = asyncio.run(pool_stats.collect(APP, stale_after_s=60))
        on = {s.replica_id: s.num_running + s.num_waiting for s in snaps if s.time > started}
        if sum(on.values()) >= len(threads):
            break
        time.sleep(0.1)
    victim, held = max(on.items(), key=lambda kv: kv[1], default=("", 0))
    assert held >= 1, on
    name = next(a for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"])
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=True)
    for t in threads:
        t.join(BOUND_S + 30)
    assert all(not t.is_alive() for t in threads), "no request may hang"
    failed = [o for o in outcomes if isinstance(o[1], Unavailable) or o[1] == 503]
    ok = [o for o in outcomes if o[1] in ("completed", 200)]
    assert len(failed) == held, outcomes
    assert len(ok) == 6 - held, outcomes
    assert all(o[2] - killed_at < 10 for o in failed), "requests on the dead replica must fail fast"
    with Client(target, timeout=60, max_retries=5, backoff=0.5) as c:
        assert len(c.generate("after", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_requests_avoid_a_replica_whose_engine_died(serving):
    """Two replicas, one engine dies (test-only hook): that replica exits at once and the ingress
    retries whatever it had not started on the other one, so no new request fails."""
    deadline = time.monotonic() + 120
    while len(worker_infos(8)) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    infos = worker_infos(8)
    assert len(infos) == 2
    victim = worker_handle().debug_kill_engine.remote().result(timeout_s=30)
    assert victim > 0
    base = f"http://127.0.0.1:{serving.server.http_port}"
    codes = []
    with Client(f"127.0.0.1:{serving.server.grpc_port}", timeout=60, max_retries=0) as c:
        for _i in range(12):
            codes.append(
                httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).status_code
            )
            codes.append(len(c.generate("x", max_tokens=2, ignore_eos=True).token_ids))
    assert codes == [200, 2] * 12

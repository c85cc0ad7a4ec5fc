"""Issue 8's hostile-client repros against a real deployment (Serve's proxies on the session's Ray
cluster), over HTTP and gRPC: every bad input is a JSON 4xx / INVALID_ARGUMENT naming the limit
or field; health per service; pool metrics; a slowloris is cut off; a dead engine makes its
replica unhealthy and Serve replaces it. Tests run in file order: the engine-death test is last."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2

from client import Client, InvalidArgument
from tests.cluster.serving_helpers import deployed, error_of, post
from tests.cluster_rayfree.test_limits import deep_request_bytes
from tests.conftest import TEST_READ_TIMEOUT_S

pytestmark = pytest.mark.ray

APP = "hardening"
GENERATE = "/logitpool.v1.LogitPool/Generate"
CHECK = "/grpc.health.v1.Health/Check"


@pytest.fixture(scope="module")
def app(serve_ports, tiny_model_dir):
    yield from deployed(serve_ports, tiny_model_dir, APP, {"max_num_seqs": 8, "max_model_len": 512})


@pytest.fixture(scope="module")
def base(app) -> str:
    return f"http://127.0.0.1:{app.server.http_port}"


@pytest.fixture(scope="module")
def channel(app):
    with grpc.insecure_channel(f"127.0.0.1:{app.server.grpc_port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def client(app):
    with Client(f"127.0.0.1:{app.server.grpc_port}", timeout=60, application=APP) as c:
        yield c


def raw_call(channel, method: str, payload: bytes) -> grpc.RpcError:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        call(payload, timeout=30, metadata=(("application", APP),))
    return err.value


# -- HTTP ------------------------------------------------------------------------------------


def test_body_too_large_is_413(base):
    r = post(base, b'{"prompt": "' + b"x" * (2 << 20) + b'"}')
    assert "limits.max_body_bytes" in error_of(r, 413)["message"]


def test_non_json_content_type_is_415(base):
    r = post(base, b"prompt=x", headers={"content-type": "application/x-www-form-urlencoded"})
    assert "application/json" in error_of(r, 415)["message"]


@pytest.mark.parametrize("depth", [100_000, 500])
def test_deep_nesting_is_400(base, depth):
    body = b'{"prompt":"x","vllm_xargs":{"a":' + b"[" * depth + b"]" * depth + b"}}"
    assert "limits.max_json_depth" in error_of(post(base, body), 400)["message"]


@pytest.mark.parametrize(
    ("body", "limit"),
    [
        ({"prompt": "x", "vllm_xargs": {f"k{i}": i for i in range(10_000)}}, "max_extra_args_keys"),
        ({"prompt": "x", "n": 2000}, "max_n"),
        ({"prompt": ["x"] * 400, "max_tokens": 1}, "max_prompts"),
        ({"prompt": "x", "stop": ["a"] * 100}, "max_stop"),
    ],
)
def test_limits_are_400_naming_the_limit(base, body, limit):
    assert f"limits.{limit}" in error_of(post(base, body), 400)["message"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", '{"prompt": "x", "model": "\\ud800"}', "model"),
        ("/v1/completions", '{"prompt": "a\\udfffb"}', "prompt"),
        ("/v1/completions", '{"prompt": "x", "bad_words": ["\\ud800"]}', "bad_words.0"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content"),
        ("/v1/chat/completions", '{"messages": [{"role": "\\ud83d", "content": "x"}]}', "messages.0.role"),
    ],
)
def test_lone_surrogates_are_400(base, path, body, field):
    err = error_of(post(base, body, path), 400)
    assert err["param"] == field and "surrogate" in err["message"]


def test_nan_logit_bias_is_400(base):
    assert "NaN" in error_of(post(base, b'{"prompt": "x", "logit_bias": {"5": NaN}}'), 400)["message"]


def test_framework_errors_are_json(base):
    assert error_of(httpx.get(base + "/v1/nothing-here"), 404)["type"] == "not_found"
    assert "GET /v1/completions" in error_of(httpx.get(base + "/v1/completions"), 405)["message"]


def test_non_finite_logprobs_stay_valid_json(base):
    body = {
        "prompt": "x",
        "max_tokens": 3,
        "allowed_token_ids": [5, 6],
        "logprobs": 3,
        "logprobs_mode": "processed_logprobs",
        "ignore_eos": True,
    }
    r = post(base, body)
    assert r.status_code == 200, r.text[:300]
    assert "Infinity" not in r.text and "NaN" not in r.text
    lines = [ln for ln in post(base, {**body, "stream": True}).text.splitlines() if ln.startswith("data: {")]
    assert lines and all(json.loads(ln[6:]) for ln in lines)  # every event parses as strict JSON


def test_openapi_declares_the_request_bodies(base):
    doc = httpx.get(base + "/openapi.json").json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + model) and "properties" in doc["components"]["schemas"][model]
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"]
    error = doc["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    assert set(error["required"]) == {"message", "type", "code", "param"}
    assert all("default" in op["responses"] for methods in doc["paths"].values() for op in methods.values())


# -- gRPC ------------------------------------------------------------------------------------


def test_grpc_garbage_bytes_are_invalid_argument(channel):
    for method in (GENERATE, CHECK):
        err = raw_call(channel, method, b"\xff\xfe garbage \x00\x01")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "not a valid" in err.details() and "DecodeError" not in err.details() and "<class" not in err.details()


def test_grpc_deep_extra_args_are_invalid_argument(channel):
    err = raw_call(channel, GENERATE, deep_request_bytes(200))  # past protobuf's recursion limit
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "<class" not in err.details()
    err = raw_call(channel, GENERATE, deep_request_bytes(20))  # parses, then fails the depth limit
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "limits.max_extra_args_depth" in err.details()


def test_grpc_applies_the_same_limits(client):
    with pytest.raises(InvalidArgument, match=r"limits.max_n"):
        client.generate("x", n=2000)
    with pytest.raises(InvalidArgument, match=r"limits.max_extra_args_keys"):
        client.generate("x", extra_args={f"k{i}": i for i in range(10_000)})
    with pytest.raises(InvalidArgument, match=r"limits.max_stop"):
        client.generate("x", bad_words=["w"] * 100)
    assert len(client.generate("x", max_tokens=2, ignore_eos=True).token_ids) == 2


def test_grpc_health_per_service(channel, client):
    assert client.health() and client.health("logitpool.v1.LogitPool")
    err = raw_call(channel, CHECK, health_pb2.HealthCheckRequest(service="no.such.Service").SerializeToString())
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no.such.Service" in err.details()


# -- health, metrics, slow clients -----------------------------------------------------------


def test_metrics_cover_the_whole_pool(base):
    post(base, {"prompt": "x", "max_tokens": 2})
    post(base, {"prompt": "x", "n": 2000})
    # Every ingress replica's series as last published (cluster.metrics.shared), labelled with it.
    rejected = re.compile(r'logitpool_requests_rejected_total\{ingress="[^"]+",protocol="http",status="400"\}')
    deadline = time.monotonic() + 10
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(base + "/metrics").text
        if 'logitpool_sequences_finished_total{reason="length"}' in text and rejected.search(text):
            break
        time.sleep(0.5)
    for name in (
        'logitpool_worker_replicas{state="alive"} 1.0',
        "logitpool_running_sequences",
        "logitpool_waiting_sequences",
        'logitpool_sequences_finished_total{reason="length"}',
        "logitpool_engine_restarts_total",
        'stat="bytes"',
    ):
        assert name in text, name
    assert rejected.search(text)


@pytest.mark.slow
def test_slowloris_is_cut_off_while_others_are_served(base, app):
    """40 loopback sockets dribble headers or a body; each is closed within the read timeout
    (tests/conftest.py sets it), while normal requests keep being answered."""
    port = app.server.http_port
    baseline = []
    for _ in range(10):
        t = time.monotonic()
        assert post(base, {"prompt": "x", "max_tokens": 2}).status_code == 200
        baseline.append(time.monotonic() - t)
    socks, closed_after = [], {}
    start = time.monotonic()
    for i in range(40):
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        if i % 2:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 1000\r\n\r\n{"
            )
        else:
            s.sendall(b"GET /health HTTP/1.1\r\n")
        socks.append(s)
    stop = threading.Event()
    latencies: list[float] = []

    def normal() -> None:
        while not stop.is_set():
            t = time.monotonic()
            r = post(base, {"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
            latencies.append(time.monotonic() - t)

    worker = threading.Thread(target=normal)
    worker.start()
    try:
        limit = start + TEST_READ_TIMEOUT_S + 6
        while len(closed_after) < len(socks) and time.monotonic() < limit:
            for i, s in enumerate(socks):
                if i in closed_after:
                    continue
                try:
                    s.settimeout(0.01)
                    s.sendall(b"x-a: b\r\n" if i % 2 == 0 else b" ")
                    data = s.recv(4096)
                    if data == b"" or b"408" in data:
                        closed_after[i] = time.monotonic() - start
                except (TimeoutError, BlockingIOError):
                    pass
                except OSError:  # reset / broken pipe: closed by the server
                    closed_after[i] = time.monotonic() - start
            time.sleep(0.2)
    finally:
        stop.set()
        worker.join(60)
        for s in socks:
            s.close()
    assert len(closed_after) == 40, f"{40 - len(closed_after)} slow sockets still open"
    assert max(closed_after.values()) < TEST_READ_TIMEOUT_S + 6
    assert latencies, "no normal request completed during the attack"
    med = sorted(latencies)[len(latencies) // 2]
    print(
        f"slowloris: 40 sockets closed after max {max(closed_after.values()):.1f}s (timeout "
        f"{TEST_READ_TIMEOUT_S}s); normal requests: median {med * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms "
        f"during ({len(latencies)}), median {sorted(baseline)[5] * 1000:.0f} ms before"
    )


# -- engine death (last: it replaces the replica) -------------------------------------------


@pytest.mark.slow
def test_engine_death_makes_health_fail_until_a_replacement_serves(base, client):
    """Counted in heartbeats, not seconds (a loaded CI box stretches seconds): the dead replica's
    first published snapshot after the kill says it is dead, and /health read after that snapshot
    is 503 unless a replacement is already alive."""
    import asyncio

    from ray import serve

    from cluster import pool_stats

    handle = serve.get_deployment_handle("LogitpoolWorker", app_name=APP)
    before = handle.info.remote().result(timeout_s=30)["replica_id"]
    post(base, {"prompt": "x", "max_tokens": 2})  # the engine loop is running
    killed_at = handle.debug_kill_engine.remote().result(timeout_s=30)
    deadline = time.monotonic() + 90
    first = None
    while first is None and time.monotonic() < deadline:
        snaps = asyncio.run(pool_stats.collect(APP, stale_after_s=60))
        first = next((s for s in snaps if s.replica_id == before and s.time > killed_at), None)
        time.sleep(0.1)
    assert first is not None, "the dead replica must keep publishing its state"
    assert not first.alive, "the first heartbeat after the engine died must report it dead"
    r = httpx.get(base + "/health", timeout=30)
    replacement_alive = any(s.alive and s.replica_id != before for s in asyncio.run(pool_stats.collect(APP)))
    assert r.status_code == 503 or replacement_alive, "health must turn 503 once the engine is dead"
    saw_unhealthy = time.time() - killed_at
    while time.monotonic() < deadline and httpx.get(base + "/health", timeout=30).status_code != 200:
        time.sleep(0.2)
    recovered = time.time() - killed_at
    assert httpx.get(base + "/health").status_code == 200, "a replacement replica must become healthy"
    after = handle.info.remote().result(timeout_s=30)["replica_id"]
    assert after != before
    assert len(client.generate("x", max_tokens=2, ignore_eos=True).token_ids) == 2
    print(f"engine death: /health 503 after {saw_unhealthy:.1f}s, healthy replacement after {recovered:.1f}s")

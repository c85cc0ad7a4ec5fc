"""API keys and overload on a real deployment: 401 / UNAUTHENTICATED without the key (health stays
open), and 503 / RESOURCE_EXHAUSTED once Serve's queue limits are reached — never a hang."""

from __future__ import annotations

import threading

import httpx
import pytest

from client import Client, ResourceExhausted, Unauthenticated
from cluster.config import LogitpoolConfig

pytestmark = pytest.mark.ray

APP = "limits"
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def limited(serve_ports, tiny_model_dir):
    from ray import serve

    from cluster.cli.launch import wait_ready
    from tests.cluster.serving_helpers import deploy

    cfg = LogitpoolConfig.model_validate(
        {
            "engine": {
                "model": str(tiny_model_dir),
                "max_num_seqs": 2,
                "max_num_batched_tokens": 256,
                "max_model_len": 1024,
            },
            "workers": {"num_replicas": 1, "max_ongoing_requests": 2, "max_queued_requests": 1},
            "server": {"http_port": serve_ports[0], "grpc_port": serve_ports[1]},
            "api_keys": [KEY],
            "app_name": APP,
        }
    )
    deploy(cfg)
    wait_ready("127.0.0.1", serve_ports[0], timeout_s=180)
    yield cfg
    serve.delete(APP)


def test_http_requires_the_api_key(limited):
    base = f"http://127.0.0.1:{limited.server.http_port}"
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
    wrong = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "invalid API key" in wrong.json()["error"]["message"]
    assert httpx.get(f"{base}/v1/models").status_code == 401
    ok = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{base}/health").status_code == 200


def test_grpc_requires_the_api_key(limited):
    target = f"127.0.0.1:{limited.server.grpc_port}"
    with Client(target, timeout=30) as c:
        with pytest.raises(Unauthenticated):
            c.generate("x", max_tokens=2)
        with pytest.raises(Unauthenticated):
            c.processors()
        assert c.health()
    with Client(target, api_key="nope", timeout=30) as c, pytest.raises(Unauthenticated):
        c.generate("x", max_tokens=2)
    with Client(target, api_key=KEY, timeout=30) as c:
        assert len(c.generate("x", max_tokens=2, ignore_eos=True).token_ids) == 2


def test_overload_is_rejected_not_queued_forever(limited):
    """Worker capacity 2 running + 1 queued: of 8 simultaneous long requests some get 503 /
    RESOURCE_EXHAUSTED at once, the rest complete."""
    base = f"http://127.0.0.1:{limited.server.http_port}"
    target = f"127.0.0.1:{limited.server.grpc_port}"
    outcomes: list[object] = []
    lock = threading.Lock()

    def http_call():
        r = httpx.post(
            f"{base}/v1/completions",
            json={"prompt": "x", "max_tokens": 300, "ignore_eos": True},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        )
        with lock:
            outcomes.append(r.status_code)

    def grpc_call():
        with Client(target, api_key=KEY, timeout=120, max_retries=0) as c:
            try:
                c.generate("x", max_tokens=300, ignore_eos=True)
                result: object = "ok"
            except ResourceExhausted as exc:
                result = exc
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=f) for f in (http_call, grpc_call) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert all(not t.is_alive() for t in threads)
    rejected = [o for o in outcomes if o == 503 or isinstance(o, ResourceExhausted)]
    completed = [o for o in outcomes if o in (200, "ok")]
    assert len(rejected) + len(completed) == 8, outcomes
    assert rejected and len(completed) >= 3, outcomes

"""Issue 17's ingress bounds through the real adapters against the fake engine, in Serve's local
testing mode (no Ray cluster): an over-long prompt is refused without tokenizing; tokenizing and
chat templating run off the event loop (/health and a small request are answered while a long
prompt is being tokenized); the response a request asks for is bounded before dispatch (HTTP and
gRPC); a large response is written in pieces, the same bytes as written whole."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from ray import serve

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster import frontend as frontend_module
from cluster.config import LogitpoolConfig
from cluster.frontend import Frontend
from cluster.grpc_servicers import GrpcRejected
from cluster.openai import adapter as http_adapter
from cluster.openai.adapter import HttpAdapter
from cluster.openai.routes import build_api
from cluster.rpc.service import GrpcAdapter
from cluster.worker_deployment import WorkerDeployment
from tests.cluster_rayfree.fake_engine import FakeEngine
from tests.cluster_rayfree.test_frontend_local import KEY, _ctx

RESPONSE_LIMIT = 2000
MARK = "<<slow>>"


@pytest.fixture(scope="module")
def cfg(tiny_model_dir) -> LogitpoolConfig:
    return LogitpoolConfig.model_validate(
        {
            "engine": {"model": str(tiny_model_dir), "load_entry_points": False},
            "api_keys": [KEY],
            "limits": {"max_prompts": 100, "max_n": 100, "max_response_logprobs": RESPONSE_LIMIT},
        }
    )


@pytest.fixture(scope="module")
def worker(cfg: LogitpoolConfig) -> Any:
    return serve.run(
        WorkerDeployment.bind(engine=cfg.engine.as_kwargs(), stream_interval_s=0.0, engine_factory=FakeEngine),
        name="fake-worker-bounds",
        route_prefix=None,
        _local_testing_mode=True,
    )


class Tokenizing:
    """Counts the tokenizer's encode calls; one whose text holds MARK waits for `release`."""

    def __init__(self, encode: Any) -> None:
        self.encode, self.calls = encode, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if isinstance(text, str) and MARK in text:
            self.entered.set()
            self.release.wait(30)  # bounded: on a blocked event loop the test fails, not hangs
        return self.encode(text, *args, **kwargs)


@pytest.fixture
def fe(cfg: LogitpoolConfig, worker: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Frontend]:
    async def pool() -> list[dict[str, Any]]:
        return [await worker.stats.remote()]

    monkeypatch.setattr(frontend_module, "REPLICA_RETRY_BACKOFF_S", 0.0)
    monkeypatch.setattr(FakeEngine, "mode", "ok")
    monkeypatch.setattr(FakeEngine, "alive", True)
    monkeypatch.setattr(FakeEngine, "seen", [])
    front = Frontend(cfg, worker, pool=pool)
    monkeypatch.setattr(front.tokenizer, "encode", Tokenizing(front.tokenizer.encode))
    yield front


def client(fe: Frontend) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=build_api(HttpAdapter(fe)))
    return httpx.AsyncClient(
        transport=transport, base_url="http://test", timeout=60, headers={"Authorization": f"Bearer {KEY}"}
    )


def post(fe: Frontend, path: str, body: dict) -> httpx.Response:
    async def call() -> httpx.Response:
        async with client(fe) as c:
            return await c.post(path, json=body)

    return asyncio.run(call())


def _completion(prompt: str) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": prompt, "max_tokens": 2}


def _chat(prompt: str) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}


# -- item 5: a cheap bound before tokenizing, and tokenizing off the event loop ----------------


@pytest.mark.parametrize(("build", "param"), [(_completion, "prompt"), (_chat, "messages")])
def test_an_overlong_prompt_is_refused_without_tokenizing(fe: Frontend, build, param) -> None:
    assert fe.max_prompt_chars is not None  # the tiny model's byte-level BPE has a bound
    path, body = build("a" * (fe.max_prompt_chars + 1))
    r = post(fe, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "cannot fit in max_model_len" in err["message"]
    assert fe.tokenizer.encode.calls == 0 and FakeEngine.seen == []


@pytest.mark.parametrize("build", [_completion, _chat])
def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(fe: Frontend, build) -> None:
    """While a long prompt is being tokenized (held there until released), /health and a small
    request are answered; then the long one completes too."""
    spy = fe.tokenizer.encode
    path, body = build("the end. " * 500 + MARK)  # about 1,500 tokens: fits
    assert len(body.get("prompt") or body["messages"][0]["content"]) > frontend_module.INLINE_PROMPT_CHARS

    async def scenario() -> tuple[int, int, bool, int]:
        async with client(fe) as c:
            big = asyncio.create_task(c.post(path, json=body))
            while not spy.entered.is_set():  # bounded by the spy's own wait
                await asyncio.sleep(0.01)
            health = await c.get("/health")
            small = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            pending = not big.done()
            spy.release.set()
            return health.status_code, small.status_code, pending, (await big).status_code

    health, small, pending, status = asyncio.run(scenario())
    assert (health, small) == (200, 200)
    assert pending, "the small requests waited for the long prompt's tokenizing"
    assert status == 200


# -- item 2: the response a request may ask for -----------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": [[5] * 100] * 6, "max_tokens": 1, "prompt_logprobs": 3},  # 6 x 100 x 4 = 2400
        {"prompt": [[5] * 100] * 2, "max_tokens": 1, "n": 3, "prompt_logprobs": 3},  # copied per choice: 2400
        {"prompt": [[5] * 100], "max_tokens": 1, "n": 3, "echo": True, "logprobs": 3},  # and echoed: 2412
        {"prompt": "x", "max_tokens": 600, "logprobs": 3},  # 600 x 4 generated
    ],
)
def test_a_response_over_the_limit_is_400_before_dispatch(fe: Frontend, body: dict) -> None:
    r = post(fe, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert f"limits.max_response_logprobs ({RESPONSE_LIMIT})" in r.json()["error"]["message"]
    assert FakeEngine.seen == []


def test_a_response_within_the_limit_is_served(fe: Frontend) -> None:
    r = post(fe, "/v1/completions", {"prompt": [[5] * 100] * 4, "max_tokens": 1, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text  # 4 x 100 x 4 = 1600 entries


def test_grpc_applies_the_same_response_limit(fe: Frontend) -> None:
    ctx = _ctx()
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[8] * 10), params=pb.SamplingParams(max_tokens=600, logprobs=3)
    )
    with pytest.raises(GrpcRejected, match=r"limits.max_response_logprobs") as err:
        asyncio.run(GrpcAdapter(fe).generate(req, ctx))
    assert err.value.code == ctx.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limits.max_response_logprobs" in ctx.details() and FakeEngine.seen == []


def _normalized(r: httpx.Response) -> bytes:
    """The body with its per-response id and timestamp replaced."""
    body = re.sub(rb'"id":"[a-z]+-[0-9a-f]+"', b'"id":"ID"', r.content)
    return re.sub(rb'"created":\d+', b'"created":0', body)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": [[i + 3, 7] for i in range(70)], "max_tokens": 3, "return_token_ids": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 70}),
    ],
)
def test_a_large_response_is_written_in_pieces_the_same_bytes(
    fe: Frontend, monkeypatch: pytest.MonkeyPatch, path: str, body: dict
) -> None:
    streamed = post(fe, path, body)  # 70 choices asked for: over STREAM_ABOVE_CHOICES
    monkeypatch.setattr(http_adapter, "STREAM_ABOVE_CHOICES", 10_000)
    whole = post(fe, path, body)
    assert streamed.status_code == whole.status_code == 200, streamed.text
    assert "content-length" not in streamed.headers and "content-length" in whole.headers
    assert streamed.headers["content-type"] == "application/json"
    assert _normalized(streamed) == _normalized(whole)
    assert len(streamed.json()["choices"]) == (70 if "prompt" in body else 1)  # the fake engine: one per prompt

"""The front end and the worker deployment against a fake engine, in Serve's local testing mode:
no Ray cluster, no model step. Dispatch (token ids and validated params reach the engine),
streaming, error mapping (HTTP and gRPC) and readiness, through the real adapters and the
real `LogitpoolWorker` (its engine built by the factory)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster import frontend as frontend_module
from cluster.app import build_app
from cluster.config import LogitpoolConfig
from cluster.frontend import Frontend
from cluster.grpc_servicers import GrpcRejected
from cluster.openai.adapter import HttpAdapter
from cluster.openai.routes import build_api
from cluster.pool_stats import PoolSnapshot
from cluster.rpc.service import GrpcAdapter
from cluster.worker_deployment import WorkerDeployment
from tests.cluster_rayfree.fake_engine import FakeEngine, fake_token

KEY = "sk-local"


@pytest.fixture(scope="module")
def cfg(tiny_model_dir) -> LogitpoolConfig:
    return LogitpoolConfig.model_validate(
        {
            "engine": {
                "model": str(tiny_model_dir),
                "load_entry_points": False,
                "logits_processors": ["tests.fixtures.seed_processors:RaisingLogitsProcessor"],
            },
            "api_keys": [KEY],
        }
    )


@pytest.fixture(scope="module")
def worker(cfg: LogitpoolConfig) -> Any:
    handle = serve.run(
        WorkerDeployment.bind(engine=cfg.engine.as_kwargs(), stream_interval_s=0.0, engine_factory=FakeEngine),
        name="fake-worker",
        route_prefix=None,
        _local_testing_mode=True,
    )
    return handle


@pytest.fixture
def fe(cfg: LogitpoolConfig, worker: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Frontend]:
    async def pool() -> list[PoolSnapshot]:
        return [await worker.stats.remote()]  # one replica: its handle reaches it

    monkeypatch.setattr(frontend_module, "REPLICA_RETRY_BACKOFF_S", 0.0)
    monkeypatch.setattr(FakeEngine, "mode", "ok")
    monkeypatch.setattr(FakeEngine, "alive", True)
    monkeypatch.setattr(FakeEngine, "seen", [])
    monkeypatch.setattr(FakeEngine, "cached_tokens", None)
    yield Frontend(cfg, worker, pool=pool)


def http(fe: Frontend, method: str, path: str, body: Any = None, key: str | None = KEY) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_api(HttpAdapter(fe)))
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, json=body, headers=headers, timeout=30)

    return asyncio.run(call())


def events(r: httpx.Response) -> list[Any]:
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_dispatch_sends_token_ids_and_validated_params(fe: Frontend) -> None:
    r = http(fe, "POST", "/v1/completions", {"prompt": "def main(", "max_tokens": 3, "temperature": 0.5})
    assert r.status_code == 200, r.text
    ((_rid, prompt, params),) = FakeEngine.seen
    assert prompt == fe.tokenizer.encode("def main(")  # tokenized once, at the front end
    assert params.max_tokens == 3 and params.temperature == 0.5
    choice = r.json()["choices"][0]
    assert choice["text"] == "".join(f"<{fake_token(prompt, i)}>" for i in range(3))
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 3,
        "total_tokens": len(prompt) + 3,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_token_id_prompts_and_several_prompts(fe: Frontend) -> None:
    r = http(fe, "POST", "/v1/completions", {"prompt": [[5, 6], [7]], "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    by_index = {c["index"]: c["token_ids"] for c in r.json()["choices"]}
    assert by_index == {0: [fake_token([5, 6], 0), fake_token([5, 6], 1)], 1: [fake_token([7], 0), fake_token([7], 1)]}


def test_streaming_sends_every_token_then_done(fe: Frontend) -> None:
    body = {"prompt": [4, 9], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    evs = events(http(fe, "POST", "/v1/completions", body))
    assert evs[-1] == "[DONE]"
    chunks = [e for e in evs[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(f"<{fake_token([4, 9], i)}>" for i in range(4))
    assert len({c["created"] for c in chunks}) == 1
    assert evs[-2]["usage"]["completion_tokens"] == 4


def test_chat_streams_through_the_template(fe: Frontend) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    evs = events(http(fe, "POST", "/v1/chat/completions", body))
    assert evs[-1] == "[DONE]" and evs[0]["choices"][0]["delta"]["role"] == "assistant"
    ((_, prompt, _),) = FakeEngine.seen
    assert isinstance(prompt, list) and len(prompt) > 1


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "max_tokens": 2, "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "max_tokens": 2, "model": "other"}, 404, "model"),
        ({"prompt": "", "max_tokens": 2}, 400, "prompt"),
        ({"prompt": "x", "n": 10_000}, 400, "n"),
    ],
)
def test_bad_requests_never_reach_the_worker(fe: Frontend, body: dict, status: int, param: str) -> None:
    r = http(fe, "POST", "/v1/completions", body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert FakeEngine.seen == []


def test_missing_key_is_401(fe: Frontend) -> None:
    r = http(fe, "POST", "/v1/completions", {"prompt": "x"}, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http(fe, "GET", "/v1/models", key="wrong").status_code == 401


@pytest.mark.parametrize(
    ("mode", "status", "kind", "attempts"),
    [
        ("error", 500, "request_failed", 1),  # a processor failed this request: not retried
        ("invalid", 400, "invalid_request_error", 1),  # the engine's own check said no
        ("dead", 503, "unavailable", frontend_module.REPLICA_RETRIES + 1),  # retried, then given up
    ],
)
def test_engine_failures_map_to_statuses(fe: Frontend, mode: str, status: int, kind: str, attempts: int) -> None:
    FakeEngine.mode = mode
    r = http(fe, "POST", "/v1/completions", {"prompt": [3], "max_tokens": 2})
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == kind
    assert len(FakeEngine.seen) == attempts


def test_stream_failure_sends_error_event_then_done(fe: Frontend) -> None:
    FakeEngine.mode = "error"
    evs = events(http(fe, "POST", "/v1/completions", {"prompt": [3], "max_tokens": 2, "stream": True}))
    assert evs[-1] == "[DONE]"
    assert evs[-2]["error"]["type"] == "request_failed" and "fake processor failed" in evs[-2]["error"]["message"]


def test_timeout_is_504(fe: Frontend) -> None:
    FakeEngine.mode = "stall"
    fe.timeout_s = 0.3
    r = http(fe, "POST", "/v1/completions", {"prompt": [3], "max_tokens": 2})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"


def test_readiness_follows_the_engine(fe: Frontend) -> None:
    r = http(fe, "GET", "/health")
    assert (r.status_code, r.json()["workers_alive"]) == (200, 1)
    FakeEngine.alive = False
    assert http(fe, "GET", "/health").status_code == 503
    assert asyncio.run(fe.workers_ready()) is False


class _Call:
    """The servicer context Serve's gRPC proxy would wrap (RayServegRPCContext copies from it)."""

    def __init__(self, key: str | None) -> None:
        self._metadata = [("authorization", f"Bearer {key}")] if key else []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def auth_context(self) -> dict[str, Any]:
        return {}

    def code(self) -> None:
        return None

    def details(self) -> None:
        return None

    def peer(self) -> str:
        return "test"

    def peer_identities(self) -> None:
        return None

    def peer_identity_key(self) -> None:
        return None

    def trailing_metadata(self) -> list[Any]:
        return []


def _ctx(key: str | None = KEY) -> RayServegRPCContext:
    return RayServegRPCContext(_Call(key))


def test_grpc_generate_and_stream(fe: Frontend) -> None:
    g = GrpcAdapter(fe)
    req = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[8, 1]), params=pb.SamplingParams(max_tokens=3), request_id="client-1"
    )
    out = asyncio.run(g.generate(req, _ctx()))
    expect = [fake_token([8, 1], i) for i in range(3)]
    assert out.request_id == "client-1" and list(out.completions[0].token_ids) == expect
    assert out.usage.prompt_tokens == 2 and out.usage.completion_tokens == 3

    async def stream() -> list[pb.GenerateStreamResponse]:
        return [m async for m in g.generate_stream(req, _ctx())]

    msgs = asyncio.run(stream())
    assert [t for m in msgs for d in m.deltas for t in d.token_ids] == expect
    assert msgs[-1].usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("mode", "params", "key", "code"),
    [
        ("ok", {"max_tokens": 2, "temperature": -1.0}, KEY, grpc.StatusCode.INVALID_ARGUMENT),
        ("ok", {"max_tokens": 2}, None, grpc.StatusCode.UNAUTHENTICATED),
        ("error", {"max_tokens": 2}, KEY, grpc.StatusCode.INTERNAL),
        ("dead", {"max_tokens": 2}, KEY, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_grpc_errors_set_the_status(
    fe: Frontend, mode: str, params: dict, key: str | None, code: grpc.StatusCode
) -> None:
    FakeEngine.mode = mode
    ctx = _ctx(key)
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[8]), params=pb.SamplingParams(**params))
    with pytest.raises(GrpcRejected):
        asyncio.run(GrpcAdapter(fe).generate(req, ctx))
    assert ctx.code() == code


def test_grpc_list_processors_fills_extra_args_keys(fe: Frontend) -> None:
    listing = asyncio.run(GrpcAdapter(fe).list_processors(pb.ListProcessorsRequest(), _ctx()))
    keys = {p.name: list(p.extra_args_keys) for p in listing.processors}
    expected = {p.name: list(p.extra_args_keys or ()) for p in fe.processors.describe()}
    assert keys == expected and keys["RaisingLogitsProcessor"] == ["raise_in"]


def test_whole_application_in_local_mode(cfg: LogitpoolConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """build_app with the fake engine: the ingress deployment composes the adapters, and its gRPC
    methods (what Serve's proxy calls) reach the worker deployment."""
    monkeypatch.setattr(FakeEngine, "mode", "ok")
    monkeypatch.setattr(FakeEngine, "seen", [])
    ingress = serve.run(
        build_app(cfg, engine_factory=FakeEngine), name="fake-app", route_prefix=None, _local_testing_mode=True
    )
    req = pb.GenerateRequest(prompt="def", params=pb.SamplingParams(max_tokens=2))
    out = ingress.Generate.remote(req, _ctx()).result(timeout_s=30)
    assert len(out.completions[0].token_ids) == 2 and len(FakeEngine.seen) == 1


def test_the_frontend_is_transport_free() -> None:
    """cluster.frontend imports neither protocol wing (HTTP/OpenAI nor gRPC)."""
    import subprocess
    import sys

    code = (
        "import sys, cluster.frontend; "
        "bad = sorted(m for m in sys.modules if m.startswith(('cluster.openai', 'cluster.rpc')));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr

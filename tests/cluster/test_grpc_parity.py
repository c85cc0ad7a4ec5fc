"""One set of request rules for HTTP and gRPC (issue 17, items 9-11), side by side against one
deployed application with an API key: `model`, empty prompts, `max_tokens` against the context
and the bearer scheme give the same outcome and message on both protocols. Then what gRPC alone
has: the key and the size checked before a message is parsed, the health service's `List` and
`Watch` (UNIMPLEMENTED, no traceback), and rejected calls logged as one line, not a traceback."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from client.pb.logitpool.v1 import logitpool_pb2_grpc as pb_grpc
from cluster.chat import fit_to_context
from cluster.config import LogitpoolConfig
from tests.cluster.serving_helpers import deployed
from worker.sampling_params import INT64_MAX, SamplingParams

APP = "parity"
SERVED = "tiny"
KEY = "k-parity"
MAX_MODEL_LEN = 96
PROMPT = [5, 6, 7]  # token ids: the same prompt length on both protocols
ray = pytest.mark.ray
HTTP_CODES = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "INVALID_ARGUMENT"}


# -- max_tokens against the context: a plain reference ----------------------------------------


@given(
    prompt_len=st.integers(1, MAX_MODEL_LEN - 1),
    max_tokens=st.one_of(st.just(INT64_MAX), st.integers(1, 2 * MAX_MODEL_LEN)),
    min_frac=st.floats(0, 1),
)
def test_fit_to_context_matches_the_reference(prompt_len: int, max_tokens: int, min_frac: float) -> None:
    min_tokens = int(min(max_tokens, 4 * MAX_MODEL_LEN) * min_frac)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens)
    room = MAX_MODEL_LEN - prompt_len
    if max_tokens != INT64_MAX and max_tokens > room:  # asked for more than fits: vLLM's 400
        with pytest.raises(ValueError, match=rf"^max_tokens: .* {max_tokens} output tokens .* {prompt_len} input"):
            fit_to_context(params, prompt_len, MAX_MODEL_LEN)
        return
    fitted = fit_to_context(params, prompt_len, MAX_MODEL_LEN)
    expected = room if max_tokens == INT64_MAX else max_tokens
    assert (fitted.max_tokens, fitted.min_tokens) == (expected, min(min_tokens, expected))
    assert (params.max_tokens, params.min_tokens) == (max_tokens, min_tokens)  # the caller's is unchanged


# -- the deployment -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(serve_ports, tiny_model_dir):
    yield from deployed(
        serve_ports,
        tiny_model_dir,
        APP,
        {"max_num_seqs": 8, "max_model_len": MAX_MODEL_LEN},
        served_model_name=SERVED,
        api_keys=[KEY],
    )


@pytest.fixture(scope="module")
def channel(app):
    with grpc.insecure_channel(f"127.0.0.1:{app.server.grpc_port}") as ch:
        yield ch


def _meta(authorization: str | None) -> tuple[tuple[str, str], ...]:
    return (("application", APP),) + ((("authorization", authorization),) if authorization else ())


def _http(app: LogitpoolConfig, fields: dict[str, Any], authorization: str | None) -> tuple[str, str, int]:
    body = {"prompt": fields.get("prompt", PROMPT), **{k: v for k, v in fields.items() if k != "prompt"}}
    headers = {"Authorization": authorization} if authorization else {}
    r = httpx.post(f"http://127.0.0.1:{app.server.http_port}/v1/completions", json=body, headers=headers, timeout=60)
    if r.status_code == 200:
        return "OK", "", r.json()["usage"]["completion_tokens"]
    return HTTP_CODES[r.status_code], r.json()["error"]["message"], 0


def _grpc(channel: grpc.Channel, fields: dict[str, Any], authorization: str | None) -> tuple[str, str, int]:
    prompt = fields.get("prompt", PROMPT)
    req = (
        pb.GenerateRequest(prompt=prompt)
        if isinstance(prompt, str)
        else pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt))
    )
    if "model" in fields:
        req.model = fields["model"]
    for name in ("max_tokens", "ignore_eos"):
        if name in fields:
            setattr(req.params, name, fields[name])
    try:
        out = pb_grpc.LogitPoolStub(channel).Generate(req, timeout=60, metadata=_meta(authorization))
    except grpc.RpcError as err:
        return err.code().name, err.details(), 0
    return "OK", "", out.usage.completion_tokens


def call(
    protocol: str,
    app: LogitpoolConfig,
    channel: grpc.Channel,
    fields: dict[str, Any],
    authorization: str | None = f"Bearer {KEY}",
) -> tuple[str, str, int]:
    """(status as a gRPC code name, error message, completion tokens) of one completion request."""
    return _http(app, fields, authorization) if protocol == "http" else _grpc(channel, fields, authorization)


ROOM = MAX_MODEL_LEN - len(PROMPT)
CONTEXT_400 = (
    f"max_tokens: This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
    f"{ROOM + 1} output tokens and your prompt contains {len(PROMPT)} input tokens, for a total of "
    f"{MAX_MODEL_LEN + 1} tokens."
)
RULES: list[tuple[str, dict[str, Any], str, str, int | None]] = [
    # name, request fields, status, message (prefix), completion tokens
    ("unknown_model", {"model": "gpt-4"}, "NOT_FOUND", "model: the model `gpt-4` does not exist", None),
    ("served_model", {"model": SERVED, "max_tokens": 2, "ignore_eos": True}, "OK", "", 2),
    ("empty_prompt", {"prompt": ""}, "INVALID_ARGUMENT", "prompt: must not be empty", None),
    ("empty_token_ids", {"prompt": []}, "INVALID_ARGUMENT", "prompt: must not be empty", None),
    ("max_tokens_fill_the_context", {"max_tokens": ROOM, "ignore_eos": True}, "OK", "", ROOM),
    ("max_tokens_past_the_context", {"max_tokens": ROOM + 1}, "INVALID_ARGUMENT", CONTEXT_400, None),
    ("max_tokens_far_past_the_context", {"max_tokens": 5000}, "INVALID_ARGUMENT", "max_tokens: This model's", None),
]


@ray
@pytest.mark.parametrize(("name", "fields", "status", "message", "tokens"), RULES, ids=[r[0] for r in RULES])
def test_one_set_of_rules_for_both_protocols(app, channel, name, fields, status, message, tokens):
    outcomes = {p: call(p, app, channel, fields) for p in ("http", "grpc")}
    assert outcomes["http"] == outcomes["grpc"], outcomes  # the same status, message and output
    got_status, got_message, got_tokens = outcomes["grpc"]
    assert got_status == status and got_message.startswith(message), outcomes
    if tokens is not None:
        assert got_tokens == tokens


@ray
def test_chat_max_tokens_past_the_context_is_400(app):
    base = f"http://127.0.0.1:{app.server.http_port}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    chat = [{"role": "user", "content": "hi"}]
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(base, json={"messages": chat, field: 5000}, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in r.json()["error"]["message"]
    r = httpx.post(base, json={"messages": chat, "ignore_eos": True}, headers=headers, timeout=60)
    usage = r.json()["usage"]  # omitted: up to the context, as before
    assert r.status_code == 200 and usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN


@ray
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (f"bearer {KEY}", "OK"),
        (f"BEARER {KEY}", "OK"),
        (f"Bearer   {KEY}", "OK"),
        (f"Basic {KEY}", "UNAUTHENTICATED"),
        ("Bearer", "UNAUTHENTICATED"),
        (f"Bearer {KEY}x", "UNAUTHENTICATED"),
        (None, "UNAUTHENTICATED"),
    ],
)
def test_the_bearer_scheme_is_case_insensitive(app, channel, protocol, authorization, status):
    got, message, _ = call(protocol, app, channel, {"max_tokens": 1}, authorization=authorization)
    assert got == status, message


# -- gRPC only: order of checks, health, logs -----------------------------------------------------

GENERATE = "/logitpool.v1.LogitPool/Generate"


def _raw(channel: grpc.Channel, payload: bytes, authorization: str | None) -> grpc.RpcError:
    rpc = channel.unary_unary(GENERATE, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        rpc(payload, timeout=30, metadata=_meta(authorization))
    return err.value


@ray
def test_the_key_and_the_size_come_before_parsing(app, channel):
    garbage = b"\xff\xfe garbage \x00\x01"
    assert _raw(channel, garbage, None).code() == grpc.StatusCode.UNAUTHENTICATED  # not parsed without a key
    assert _raw(channel, garbage, f"Bearer {KEY}").code() == grpc.StatusCode.INVALID_ARGUMENT
    too_big = b"\xff" * (app.limits.max_body_bytes + 1)  # not a message either: never parsed
    assert _raw(channel, too_big, None).code() == grpc.StatusCode.UNAUTHENTICATED
    err = _raw(channel, too_big, f"Bearer {KEY}")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "limits.max_body_bytes" in err.details()


@ray
def test_health_list_and_watch(app, channel):
    stub = health_pb2_grpc.HealthStub(channel)
    listed = stub.List(health_pb2.HealthListRequest(), timeout=30, metadata=_meta(None))
    assert set(listed.statuses) == {"", "logitpool.v1.LogitPool"}
    assert all(s.status == health_pb2.HealthCheckResponse.SERVING for s in listed.statuses.values())
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=30, metadata=_meta(None)))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value.details()
    details = err.value.details()
    assert "poll Check" in details and "\n" not in details and "Traceback" not in details and "pid" not in details


def _serve_logs() -> dict[Path, int]:
    import ray as ray_module

    logs = Path(ray_module._private.worker._global_node.get_logs_dir_path()) / "serve"
    return {
        p: p.stat().st_size
        for p in logs.glob("*.log")
        if p.name.startswith("proxy_") or p.name.startswith(f"replica_{APP}_LogitpoolIngress")
    }


def _appended(before: dict[Path, int]) -> str:
    text = []
    for path in _serve_logs():
        with path.open("rb") as f:
            f.seek(before.get(path, 0))
            text.append(f.read().decode(errors="replace"))
    return "".join(text)


@ray
def test_rejected_calls_are_one_log_line_not_a_traceback(app, channel):
    before = _serve_logs()
    rejected = [
        call("grpc", app, channel, {"model": "gpt-4"}),
        call("grpc", app, channel, {"prompt": ""}),
        call("grpc", app, channel, {"max_tokens": 1}, authorization=None),
    ]
    assert [r[0] for r in rejected] == ["NOT_FOUND", "INVALID_ARGUMENT", "UNAUTHENTICATED"]
    with pytest.raises(grpc.RpcError):
        list(
            health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30, metadata=_meta(None))
        )
    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline:  # Serve writes its logs asynchronously
        text = _appended(before)
        if all(f"gRPC call rejected: {code}" in text for code in ("NOT_FOUND", "UNAUTHENTICATED", "UNIMPLEMENTED")):
            break
        time.sleep(0.5)
    lines = [line for line in text.splitlines() if "gRPC call rejected" in line]
    assert len(lines) >= 4, text[-3000:]
    assert "Traceback" not in text and "ERROR" not in "\n".join(lines), text[-3000:]


# -- Serve's own failures never reach a client as a traceback -----------------------------------


def test_serve_details_of_more_than_one_line_never_reach_the_client():
    """Serve's real proxy server class with our servicer functions, on a real port; the factory
    stands in for Serve's routing and fails each call the way Serve does for a gone replica
    (INTERNAL, str() of the error: a traceback with pid and actor id)."""
    import asyncio

    from ray.serve._private.grpc_util import gRPCGenericServer

    from cluster.grpc_servicers import add_HealthServicer_to_server

    traceback = 'ray::ServeReplica (pid=123, actor_id=abc)\nTraceback (most recent call last):\n  File "x.py"'

    def factory(service_method: str, streaming_type: Any) -> Any:
        async def unary(request: Any, context: Any) -> bytes:
            assert request.raw == b"\x0a\x01x"  # unparsed bytes (the service name "x")
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(traceback if service_method.endswith("Check") else "one line: kept")
            return b""

        async def stream(request: Any, context: Any) -> Any:
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(traceback)
            return
            yield b""

        return stream if service_method.endswith("Watch") else unary

    async def run() -> list[tuple[grpc.StatusCode, str]]:
        server = gRPCGenericServer(factory)
        add_HealthServicer_to_server(health_pb2_grpc.HealthServicer(), server)  # Serve passes a stand-in too
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                for method in ("Check", "List"):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await ch.unary_unary(f"/grpc.health.v1.Health/{method}")(b"\x0a\x01x", timeout=30)
                    out.append((err.value.code(), err.value.details()))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    [m async for m in ch.unary_stream("/grpc.health.v1.Health/Watch")(b"\x0a\x01x", timeout=30)]
                out.append((err.value.code(), err.value.details()))
        finally:
            await server.stop(0)
        return out

    (check, listed, watch) = asyncio.run(run())
    assert check == (grpc.StatusCode.INTERNAL, "internal: the server failed this call (details are in its log)")
    assert listed == (grpc.StatusCode.INTERNAL, "one line: kept")
    assert watch[0] == grpc.StatusCode.UNAVAILABLE and "pid" not in watch[1] and "\n" not in watch[1]

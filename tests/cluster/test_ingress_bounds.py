"""Issue 17's HTTP-side repros (items 2, 5, 6, 8) against a real deployment on the session's Ray
cluster and Serve proxies: a header past limits.max_header_bytes is 431 at the proxy (raw
sockets); UTF-16/32 bodies and other charsets are 415; the response a request asks for is
bounded (400 on HTTP, INVALID_ARGUMENT on gRPC) and a large one streams as valid JSON the
OpenAI SDK reads; over-long prompts are refused from their length while /health is served."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from client import Client, InvalidArgument
from cluster.limits import Limits
from tests.cluster.serving_helpers import deployed, error_of
from tests.cluster.serving_helpers import post as _post

pytestmark = pytest.mark.ray

APP = "ingress-bounds"
RESPONSE_LIMIT = 20_000
HEADER_LIMIT = Limits().max_header_bytes  # the session cluster's proxy runs with the default


@pytest.fixture(scope="module")
def app(serve_ports, tiny_model_dir):
    yield from deployed(
        serve_ports,
        tiny_model_dir,
        APP,
        {"max_num_seqs": 16, "max_model_len": 512},
        limits={"max_response_logprobs": RESPONSE_LIMIT},
    )


@pytest.fixture(scope="module")
def base(app) -> str:
    return f"http://127.0.0.1:{app.server.http_port}"


@pytest.fixture(scope="module")
def client(app):
    with Client(f"127.0.0.1:{app.server.grpc_port}", timeout=60, application=APP) as c:
        yield c


def post(*args: Any, **kw: Any) -> httpx.Response:
    """The shared POST with this module's longer wait (its requests carry megabytes)."""
    return _post(*args, timeout=120, **kw)


# -- item 6: header size ---------------------------------------------------------------------


def _head(size: int) -> bytes:
    start = "GET /health HTTP/1.1\r\nhost: t\r\nx-pad: "
    return (start + "a" * (size - len(start) - 4) + "\r\n\r\n").encode()


def _first_response(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _proxy_rss_mb(port: int) -> float:
    """Resident memory of the process listening on `port` (Serve's HTTP proxy), for the printout."""
    from tests.cluster.test_side_doors import listening_sockets

    pids = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    for pid, _, listen_port in listening_sockets(pids):
        if listen_port == port:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024
    return float("nan")


def test_a_head_past_the_limit_is_431_at_the_proxy(app):
    port = app.server.http_port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(_head(HEADER_LIMIT - 1024))
        assert _first_response(s).startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(_head(HEADER_LIMIT + 1024))
        data = _first_response(s)
        assert data.startswith(b"HTTP/1.1 431 Request Header Fields Too Large"), data[:200]
        try:
            while chunk := s.recv(65536):
                data += chunk  # until the proxy closes the connection
        except ConnectionResetError:
            pass
        body = json.loads(data.split(b"\r\n\r\n", 1)[1])
        assert f"limits.max_header_bytes ({HEADER_LIMIT})" in body["error"]["message"]


def test_eight_32_mib_headers_are_cut_off_while_health_is_served(base, app):
    """The issue's repro: eight connections each sending a 32 MiB header. Each is refused long
    before it is sent, and /health answers throughout."""
    rss_before = _proxy_rss_mb(app.server.http_port)
    stop = threading.Event()
    health: list[int] = []

    def attacker() -> int:
        sent = 0
        with socket.create_connection(("127.0.0.1", app.server.http_port), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\nx-big: ")
            try:
                while sent < 32 << 20:
                    s.sendall(b"a" * 65536)
                    sent += 65536
            except (BrokenPipeError, ConnectionResetError):
                return sent
        return -1  # all of it was taken

    def poll() -> None:
        while not stop.is_set():
            health.append(httpx.get(base + "/health", timeout=60).status_code)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            sent = list(pool.map(lambda _: attacker(), range(8)))
    finally:
        stop.set()
        poller.join(90)
    assert all(0 <= s < 8 << 20 for s in sent), sent
    assert health and set(health) == {200}
    print(
        f"header flood: 8 x 32 MiB refused after {max(sent) >> 10} KiB at most; proxy RSS "
        f"{rss_before:.0f} -> {_proxy_rss_mb(app.server.http_port):.0f} MB; /health {len(health)} x 200 meanwhile"
    )


# -- item 8: UTF-8 only -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "text", "encoding"),
    [
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "\\ud800"}}', "utf-16"),
        ("/v1/completions", '{"prompt": "x", "model": "\\udfff", "user": "\\ud800"}', "utf-16-le"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 2}', "utf-32"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "utf-16-be"),
    ],
)
def test_json_in_another_encoding_is_415(base, path, text, encoding):
    err = error_of(post(base, text.encode(encoding), path), 415)
    assert err["message"].startswith("body: JSON must be UTF-8")


def test_a_charset_other_than_utf8_is_415_and_a_bom_is_skipped(base):
    body = {"prompt": "x", "max_tokens": 2}
    err = error_of(post(base, body, headers={"content-type": "application/json; charset=utf-16"}), 415)
    assert err["message"].startswith("content-type: charset") and "UTF-8" in err["message"]
    assert post(base, body, headers={"content-type": "application/json; charset=UTF-8"}).status_code == 200
    assert post(base, b"\xef\xbb\xbf" + json.dumps(body).encode()).status_code == 200


# -- item 2: the response a request may ask for -----------------------------------------------


def test_an_amplifying_request_is_400_naming_the_limit(base):
    """8 prompts x n 8 with 20 prompt logprobs each: 8 x 8 x 50 x 21 entries > the limit."""
    prompt = " ".join(["word"] * 49)
    body = {"prompt": [prompt] * 8, "n": 8, "max_tokens": 1, "prompt_logprobs": 20}
    err = error_of(post(base, body), 400)
    assert err["param"] == "prompt_logprobs" and f"limits.max_response_logprobs ({RESPONSE_LIMIT})" in err["message"]
    body = {"prompt": prompt, "n": 4, "max_tokens": 200, "logprobs": 20, "echo": True}
    assert "limits.max_response_logprobs" in error_of(post(base, body), 400)["message"]


def test_grpc_applies_the_same_response_limit(client):
    with pytest.raises(InvalidArgument, match=r"limits\.max_response_logprobs"):
        client.generate("x", n=8, max_tokens=400, logprobs=20)


def test_a_large_response_streams_as_json_the_sdk_reads(base, oai, app):
    """80 choices (2 prompts x n 40) with echo and prompt logprobs: written in pieces (chunked,
    no content-length), one valid JSON document; every choice of a prompt carries its prompt's
    logprobs, as vLLM's response does."""
    body = {
        "prompt": ["The quick brown fox", "Once upon a time"],
        "n": 40,
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "prompt_logprobs": 2,
    }
    r = post(base, body)
    assert r.status_code == 200, r.text[:300]
    assert "content-length" not in r.headers and r.headers.get("transfer-encoding") == "chunked"
    doc = r.json()
    assert [c["index"] for c in doc["choices"]] == list(range(80))
    for group in (doc["choices"][:40], doc["choices"][40:]):
        assert all(c["prompt_logprobs"] == group[0]["prompt_logprobs"] for c in group)
        assert group[0]["prompt_logprobs"][0] is None and len(group[0]["prompt_logprobs"]) > 1
    sdk = oai.completions.create(
        model=app.served_name,
        prompt=body["prompt"],
        n=40,
        max_tokens=4,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body={"prompt_logprobs": 2},
    )
    assert len(sdk.choices) == 80 and sdk.usage.prompt_tokens == doc["usage"]["prompt_tokens"]


@pytest.fixture(scope="module")
def serving(app):
    return app  # for the session's `oai` fixture (tests/conftest.py)


# -- item 5: over-long prompts refused from their length ---------------------------------------


def test_overlong_prompts_are_refused_while_health_is_served(base, client):
    """The issue's repro: eight concurrent ~1 MiB prompts (completions and chat). Each is a 400
    naming its field, from its length; /health answers throughout."""
    huge = "a" * 1_000_000
    stop = threading.Event()
    health: list[float] = []

    def poll() -> None:
        while not stop.is_set():
            t = time.monotonic()
            assert httpx.get(base + "/health", timeout=60).status_code == 200
            health.append(time.monotonic() - t)
            time.sleep(0.05)

    def attack(i: int) -> tuple[int, str | None]:
        if i % 2:
            r = post(base, {"messages": [{"role": "user", "content": huge}]}, "/v1/chat/completions")
        else:
            r = post(base, {"prompt": huge, "max_tokens": 2})
        return r.status_code, r.json()["error"]["param"]

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        t = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(attack, range(8)))
        took = time.monotonic() - t
    finally:
        stop.set()
        poller.join(90)
    assert outcomes == [(400, "prompt"), (400, "messages")] * 4
    assert health, "no /health answer during the attack"
    with pytest.raises(InvalidArgument, match="cannot fit in max_model_len"):
        client.generate(huge, max_tokens=2)
    print(
        f"8 x 1 MB prompts: all 400 within {took:.2f}s; /health during: {len(health)} answers, "
        f"max {max(health) * 1000:.0f} ms"
    )

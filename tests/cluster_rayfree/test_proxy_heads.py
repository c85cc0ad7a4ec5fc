"""cluster.slow_clients's header limit (and its read timeout) on uvicorn's two HTTP protocols,
without Ray: a real uvicorn server in a thread, its protocol class a subclass patched exactly as
`install` patches Serve's proxy, and raw sockets on loopback. The same limit through a real
Serve proxy: tests/cluster/test_ingress_bounds.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Self

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cluster.slow_clients import _patch, _widen_h11
from tests.conftest import free_port

LIMIT = 32 << 10  # above h11's own 16 KiB, so the widening is exercised too
READ_TIMEOUT_S = 3.0


class Server:
    """uvicorn on 127.0.0.1 serving an app that reports what it received."""

    def __init__(self, protocol: type) -> None:
        self.port = free_port()
        self.requests: list[tuple[int, int]] = []  # (header bytes, body bytes) the app saw
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            http=protocol,
            interface="asgi3",
            lifespan="off",
            log_level="error",
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def app(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.requests.append((sum(len(k) + len(v) for k, v in scope["headers"]), len(body)))
        payload = json.dumps({"body": len(body)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _protocol(base: type) -> type:
    cls = type(f"Limited{base.__name__}", (base,), {})
    if base is H11Protocol:
        _widen_h11(cls, LIMIT)
    _patch(cls, READ_TIMEOUT_S, LIMIT)
    return cls


@pytest.fixture(scope="module", params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def server(request) -> Iterator[Server]:
    with Server(_protocol(request.param)) as s:
        yield s


def head(size: int, method: str = "GET", extra: str = "") -> bytes:
    """A request head of exactly `size` bytes (one padding header makes up the size)."""
    start = f"{method} /x HTTP/1.1\r\nhost: t\r\n{extra}x-pad: "
    pad = size - len(start) - 4
    assert pad >= 0
    return (start + "a" * pad + "\r\n\r\n").encode()


class Conn:
    """A client socket that reads content-length framed responses, keeping what follows."""

    def __init__(self, server: Server) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        self.buffer = b""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def response(self) -> tuple[int, bytes]:
        """Status and body of the next response; (0, b"") when the connection closes first."""
        while b"\r\n\r\n" not in self.buffer:
            if not self._fill():
                return 0, b""
        top, rest = self.buffer.split(b"\r\n\r\n", 1)
        length = next(
            int(line.split(b":")[1]) for line in top.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        while len(rest) < length:
            if not self._fill():
                return 0, b""
            top, rest = self.buffer.split(b"\r\n\r\n", 1)
        self.buffer = rest[length:]
        return int(top.split()[1]), rest[:length]

    def closed(self) -> bool:
        try:
            return not self.buffer and self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def test_a_head_up_to_the_limit_is_served(server):
    with Conn(server) as s:
        s.sendall(head(LIMIT))
        assert s.response()[0] == 200


def test_a_head_past_the_limit_is_431_and_never_reaches_the_app(server):
    seen = len(server.requests)
    with Conn(server) as s:
        s.sendall(head(LIMIT + 1))
        status, body = s.response()
        assert status == 431
        assert f"limits.max_header_bytes ({LIMIT})" in json.loads(body)["error"]["message"]
        assert s.closed()
    assert len(server.requests) == seen


def test_an_endless_header_is_cut_off_as_it_arrives(server):
    """A 32 MiB header sent in pieces: answered 431 and closed long before it is all sent."""
    seen = len(server.requests)
    with Conn(server) as s:
        s.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\nx-big: ")
        sent, refused = 0, False
        try:
            while sent < 32 << 20:
                s.sendall(b"a" * 4096)
                sent += 4096
        except (BrokenPipeError, ConnectionResetError):
            refused = True
        assert refused, "the server read a 32 MiB header"
    assert sent < 8 << 20 and len(server.requests) == seen


def test_a_head_dribbled_in_small_pieces_is_counted_whole(server):
    with Conn(server) as s:
        data = head(LIMIT + 100)
        for i in range(0, len(data), 3000):
            s.sendall(data[i : i + 3000])
        assert s.response()[0] == 431


def test_body_bytes_do_not_count(server):
    body = b"x" * (4 * LIMIT)
    with Conn(server) as s:
        s.sendall(head(1000, "POST", f"content-length: {len(body)}\r\n") + body)
        status, payload = s.response()
        assert status == 200 and json.loads(payload) == {"body": len(body)}


def test_each_request_on_a_kept_alive_connection_is_counted_afresh(server):
    with Conn(server) as s:
        for _ in range(3):  # each well under the limit, together over it
            s.sendall(head(LIMIT // 2))
            assert s.response()[0] == 200
        s.sendall(head(LIMIT + 10))
        assert s.response()[0] == 431


def test_pipelined_requests_are_served(server):
    with Conn(server) as s:
        s.sendall(head(LIMIT // 2) + head(LIMIT // 2))
        assert s.response()[0] == 200
        assert s.response()[0] == 200


def test_the_read_timeout_still_answers_408(server):
    with Conn(server) as s:
        s.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n")  # and nothing more
        status, body = s.response()  # within READ_TIMEOUT_S; the socket's 30 s bound if not
        assert status == 408 and "limits.read_timeout_s" in json.loads(body)["error"]["message"]

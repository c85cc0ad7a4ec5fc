"""The proxy hook's write-stall bound (cluster.slow_clients), on a real uvicorn server: a client
that opens a stream and stops reading is disconnected once writes stay paused past the bound, so
the app sees the disconnect (Serve then cancels the request) and stops producing; a client that
reads slowly but keeps reading is not."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cluster.slow_clients import _bound_write_stalls

CHUNK = b"x" * 65536
MAX_CHUNKS = 4000  # 256 MiB: far past any socket buffer; an unbounded server would send it all
STALL_S = 0.5


class Streamer:
    """An ASGI app streaming CHUNKs until the client is gone; records what it could send."""

    def __init__(self) -> None:
        self.sent = 0
        self.disconnected = threading.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Like Serve's proxy: a task waits for ``http.disconnect`` and ends the response."""
        assert scope["type"] == "http"

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()

        watcher = asyncio.create_task(watch())
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for _ in range(MAX_CHUNKS):
            if self.disconnected.is_set():
                return
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            self.sent += 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        watcher.cancel()


def _serve(app: Streamer, protocol: type) -> tuple[uvicorn.Server, int, threading.Thread]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, http=protocol, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    return server, port, thread


def _client(port: int, rcvbuf: int | None = 4096) -> socket.socket:
    c = socket.socket()
    if rcvbuf is not None:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    c.connect(("127.0.0.1", port))
    c.sendall(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
    return c


@pytest.fixture(params=[H11Protocol, HttpToolsProtocol], ids=["h11", "httptools"])
def protocol(request: pytest.FixtureRequest) -> type:
    cls = type(f"Bounded{request.param.__name__}", (request.param,), {})
    _bound_write_stalls(cls, STALL_S)
    return cls


def test_a_reader_that_stops_is_disconnected(protocol: type) -> None:
    app = Streamer()
    server, port, thread = _serve(app, protocol)
    try:
        c = _client(port)
        c.recv(1024)  # the stream has started; then this client reads nothing more
        assert app.disconnected.wait(120), "the server kept the stalled connection"
        assert app.sent < MAX_CHUNKS // 4, app.sent  # it stopped producing long before the end
        c.settimeout(60)
        while c.recv(1 << 20):  # what was in flight, then EOF: the server closed the connection
            pass
        c.close()
    finally:
        server.should_exit = True
        thread.join(60)


def test_a_slow_reader_is_not_disconnected(protocol: type) -> None:
    """Pauses shorter than the bound (the client reads 1 MiB every STALL_S / 5) never close it."""
    app = Streamer()
    server, port, thread = _serve(app, protocol)
    try:
        c = _client(port, rcvbuf=None)
        got = 0
        for _ in range(40):  # 40 × STALL_S / 5 = 4 bounds' worth of time, reading all along
            got += sum(len(c.recv(1 << 16)) for _ in range(16))
            time.sleep(STALL_S / 5)
        assert not app.disconnected.is_set() and got > 0
        c.close()
        assert app.disconnected.wait(120)  # and a client that leaves is noticed as before
    finally:
        server.should_exit = True
        thread.join(60)

"""A read timeout for the HTTP port, installed inside Serve's HTTP proxy.

Serve's HTTP proxy is uvicorn, and Ray Serve 2.60 bounds nothing about reading a request:
`keep_alive_timeout_s` only covers idle time *between* requests and `request_timeout_s` starts
once a request has arrived, so a client dribbling headers or a body one byte at a time
(slowloris) holds a connection for ever. The proxy runs one hook of ours: the callback named by
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (set to `CALLBACK` by `logitpool serve` and the test
cluster). `install` wraps uvicorn's HTTP protocols so that a request's headers *and* body must
arrive within `limits.read_timeout_s` of the connection opening, or of the first byte of a later
request on the same connection; otherwise the proxy answers 408 (when nothing was sent yet)
and closes the connection. Responses, however long they stream, are not affected.
"""

from __future__ import annotations

import json
import os
from typing import Any

CALLBACK = "cluster.slow_clients:install"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
TIMEOUT_ENV = "LOGITPOOL_HTTP_READ_TIMEOUT_S"


def proxy_env(read_timeout_s: float) -> dict[str, str]:
    """Environment for the processes of a Ray cluster so its Serve HTTP proxy installs the timeout."""
    return {CALLBACK_ENV: CALLBACK, TIMEOUT_ENV: repr(float(read_timeout_s))}


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps({"error": {
        "message": f"request not received within limits.read_timeout_s ({timeout_s:g}s)",
        "type": "invalid_request_error", "code": 408, "param": None,
    }}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


def _request_read(protocol: Any) -> bool:
    """Whether the request on this connection has been received in full (headers and body)."""
    cycle = protocol.cycle
    return cycle is not None and cycle is not getattr(protocol, "_lp_read_cycle", None) and not cycle.more_body


def _patch(cls: Any, timeout_s: float) -> None:
    if getattr(cls, "_lp_read_timeout", None) is not None:
        return
    connection_made, data_received, connection_lost = cls.connection_made, cls.data_received, cls.connection_lost

    def expire(self: Any) -> None:
        self._lp_timer = None
        transport = self.transport
        if transport is None or transport.is_closing() or _request_read(self):
            return
        cycle = self.cycle
        if cycle is None or cycle is getattr(self, "_lp_read_cycle", None) or not cycle.response_started:
            transport.write(_timeout_response(timeout_s))
        transport.close()

    def arm(self: Any) -> None:
        self._lp_timer = self.loop.call_later(timeout_s, expire, self)

    def disarm(self: Any) -> None:
        timer = getattr(self, "_lp_timer", None)
        if timer is not None:
            timer.cancel()
        self._lp_timer = None

    def patched_connection_made(self: Any, transport: Any) -> None:
        connection_made(self, transport)
        self._lp_read_cycle = None
        arm(self)

    def patched_data_received(self: Any, data: bytes) -> None:
        if getattr(self, "_lp_timer", None) is None:
            arm(self)  # the first byte of a later request on a kept-alive connection
        data_received(self, data)
        if _request_read(self):
            self._lp_read_cycle = self.cycle  # read in full: the clock stops until the next request
            disarm(self)

    def patched_connection_lost(self: Any, exc: Exception | None) -> None:
        disarm(self)
        connection_lost(self, exc)

    cls.connection_made = patched_connection_made
    cls.data_received = patched_data_received
    cls.connection_lost = patched_connection_lost
    cls._lp_read_timeout = timeout_s


def install() -> list[Any]:
    """The proxy callback: patch uvicorn's protocols in this (proxy) process; no middlewares."""
    from uvicorn.protocols.http import h11_impl, httptools_impl

    from cluster.limits import Limits

    timeout_s = float(os.environ.get(TIMEOUT_ENV) or Limits().read_timeout_s)
    for cls in (httptools_impl.HttpToolsProtocol, h11_impl.H11Protocol):
        _patch(cls, timeout_s)
    return []

"""A read timeout and a header size limit for the HTTP port, installed inside Serve's HTTP proxy.

Serve's HTTP proxy is uvicorn, and Ray Serve 2.60 bounds nothing about reading a request:
`keep_alive_timeout_s` only covers idle time *between* requests and `request_timeout_s` starts
once a request has arrived, so a client dribbling headers or a body one byte at a time
(slowloris) holds a connection for ever; and uvicorn's httptools parser (Serve's, since
httptools is installed) takes headers of any size (a 32 MiB header was answered 200), which
Serve then forwards to the ingress. The proxy runs one hook of ours: the callback named by
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` (set to `CALLBACK` by `logitpool serve` and the test
cluster). `install` wraps uvicorn's HTTP protocols (httptools and h11 alike) so that

- a request's headers *and* body must arrive within `limits.read_timeout_s` of the connection
  opening, or of the first byte of a later request on the same connection; otherwise the proxy
  answers 408 (when nothing was sent yet) and closes the connection. Responses, however long
  they stream, are not affected;
- a request's head (request line and headers, up to the blank line) may be at most
  `limits.max_header_bytes`: the bytes are counted as they arrive, before the parser buffers
  them, and past the limit the proxy answers 431 and closes the connection. (A pipelined
  request whose head starts inside the same read as the previous request's end is counted from
  the next read: at most one read, 64 KiB, more.) h11's own bound (16 KiB by default, answered
  400) is raised to the limit so that both answer the same.

It also returns the proxy's one middleware of ours, `cluster.request_id.SaneRequestIds`: the
`x-request-id` Serve logs and echoes is bounded and printable.
"""

from __future__ import annotations

import json
import os
from typing import Any

CALLBACK = "cluster.slow_clients:install"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
TIMEOUT_ENV = "LOGITPOOL_HTTP_READ_TIMEOUT_S"
HEADER_ENV = "LOGITPOOL_HTTP_MAX_HEADER_BYTES"
STALL_ENV = "LOGITPOOL_HTTP_WRITE_STALL_S"


def proxy_env(
    read_timeout_s: float, max_header_bytes: int | None = None, write_stall_s: float | None = None
) -> dict[str, str]:
    """Environment for the processes of a Ray cluster so its Serve HTTP proxy installs the bounds
    (defaults: `Limits()`'s)."""
    env = {CALLBACK_ENV: CALLBACK, TIMEOUT_ENV: repr(float(read_timeout_s))}
    if max_header_bytes is not None:
        env[HEADER_ENV] = str(int(max_header_bytes))
    if write_stall_s is not None:
        env[STALL_ENV] = repr(float(write_stall_s))
    return env


def _error_response(status: int, reason: str, message: str) -> bytes:
    """The proxy's own answer, in the ingress's error shape (cluster.errors.error_body)."""
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "code": status, "param": None}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    return head + body


def _timeout_response(timeout_s: float) -> bytes:
    return _error_response(
        408, "Request Timeout", f"request not received within limits.read_timeout_s ({timeout_s:g}s)"
    )


def _header_response(max_header_bytes: int) -> bytes:
    return _error_response(
        431,
        "Request Header Fields Too Large",
        f"request headers: more than limits.max_header_bytes ({max_header_bytes}) bytes",
    )


def _request_read(protocol: Any) -> bool:
    """Whether the request on this connection has been received in full (headers and body)."""
    cycle = protocol.cycle
    return cycle is not None and cycle is not getattr(protocol, "_lp_read_cycle", None) and not cycle.more_body


def _in_head(protocol: Any) -> bool:
    """Whether arriving bytes belong to a request's head: no request has started on this
    connection since the last one was read in full."""
    cycle = protocol.cycle
    return cycle is None or cycle is getattr(protocol, "_lp_read_cycle", None)


def _cancel_timer(protocol: Any, attr: str) -> None:
    """Cancel the protocol's timer kept in ``attr`` (one of ours), if one is armed."""
    timer = getattr(protocol, attr, None)
    if timer is not None:
        timer.cancel()
    setattr(protocol, attr, None)


def _expire(self: Any, timeout_s: float) -> None:
    """The read timer fired: a 408 unless a response is under way, then the connection closes."""
    self._lp_timer = None
    transport = self.transport
    if transport is None or transport.is_closing() or _request_read(self):
        return
    cycle = self.cycle
    if cycle is None or cycle is getattr(self, "_lp_read_cycle", None) or not cycle.response_started:
        transport.write(_timeout_response(timeout_s))
    transport.close()


def _refuse_head(self: Any, max_header_bytes: int) -> None:
    cycle = self.cycle
    if cycle is None or cycle.response_complete:  # not in the middle of a pipelined response
        self.transport.write(_header_response(max_header_bytes))
    self.transport.close()


def _feed(self: Any, data: bytes, data_received: Any, max_header_bytes: int) -> bool:
    """uvicorn's data_received, the head cut at max_header_bytes; False once the head is refused."""
    if _in_head(self):
        room = max_header_bytes - self._lp_head_bytes
        if len(data) > room:
            if room > 0:
                data_received(self, data[:room])
            if self.transport.is_closing():
                return False
            if _in_head(self):
                _refuse_head(self, max_header_bytes)
                return False
            data = data[room:]
        else:
            self._lp_head_bytes += len(data)
    data_received(self, data)
    if not _in_head(self):
        self._lp_head_bytes = 0
    return True


def _patch(cls: Any, timeout_s: float, max_header_bytes: int) -> None:
    if "_lp_read_timeout" in cls.__dict__:
        return
    connection_made, data_received, connection_lost = cls.connection_made, cls.data_received, cls.connection_lost

    def arm(self: Any) -> None:
        self._lp_timer = self.loop.call_later(timeout_s, _expire, self, timeout_s)

    def patched_connection_made(self: Any, transport: Any) -> None:
        connection_made(self, transport)
        self._lp_read_cycle = None
        self._lp_head_bytes = 0
        arm(self)

    def patched_data_received(self: Any, data: bytes) -> None:
        if getattr(self, "_lp_timer", None) is None:
            arm(self)  # the first byte of a later request on a kept-alive connection
        if not _feed(self, data, data_received, max_header_bytes):
            return
        if _request_read(self):
            self._lp_read_cycle = self.cycle  # read in full: the clock stops until the next request
            _cancel_timer(self, "_lp_timer")

    def patched_connection_lost(self: Any, exc: Exception | None) -> None:
        _cancel_timer(self, "_lp_timer")
        connection_lost(self, exc)

    cls.connection_made = patched_connection_made
    cls.data_received = patched_data_received
    cls.connection_lost = patched_connection_lost
    cls._lp_read_timeout = timeout_s


def _bound_write_stalls(cls: Any, stall_s: float) -> None:
    """A client that stops reading a response: once the socket's buffers are full, uvicorn pauses
    writing; if it stays paused for `stall_s`, the connection is closed. Serve then cancels the
    request (the worker aborts it and frees its row), so what Serve's proxy buffers for a reader
    that went quiet is bounded by what the stream produces in `stall_s`."""
    if "_lp_write_stall" in cls.__dict__:
        return
    pause_writing, resume_writing, connection_lost = cls.pause_writing, cls.resume_writing, cls.connection_lost

    def expire(self: Any) -> None:
        self._lp_stall_timer = None
        if self.transport is not None:
            # abort, not close: close() waits to flush the buffered bytes, which never drain.
            self.transport.abort()

    def patched_pause_writing(self: Any) -> None:
        pause_writing(self)
        if getattr(self, "_lp_stall_timer", None) is None:
            self._lp_stall_timer = self.loop.call_later(stall_s, expire, self)

    def patched_resume_writing(self: Any) -> None:
        _cancel_timer(self, "_lp_stall_timer")
        resume_writing(self)

    def patched_connection_lost(self: Any, exc: Exception | None) -> None:
        _cancel_timer(self, "_lp_stall_timer")
        connection_lost(self, exc)

    cls.pause_writing = patched_pause_writing
    cls.resume_writing = patched_resume_writing
    cls.connection_lost = patched_connection_lost
    cls._lp_write_stall = stall_s


def _widen_h11(cls: Any, max_header_bytes: int) -> None:
    """h11 refuses a head past its own buffer bound (16 KiB by default) with a 400: make that
    bound at least the limit, so the 431 above decides."""
    import h11
    from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE

    init = cls.__init__

    def patched_init(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        init(self, config, *args, **kwargs)
        own = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        if own < max_header_bytes:
            self.conn = h11.Connection(h11.SERVER, max_header_bytes)

    cls.__init__ = patched_init


def install() -> list[Any]:
    """The proxy callback: patch uvicorn's protocols in this (proxy) process; the request-id
    middleware for Serve to put in front of its own."""
    from uvicorn.protocols.http import h11_impl, httptools_impl

    from cluster import request_id
    from cluster.limits import Limits

    timeout_s = float(os.environ.get(TIMEOUT_ENV) or Limits().read_timeout_s)
    max_header_bytes = int(os.environ.get(HEADER_ENV) or Limits().max_header_bytes)
    stall_s = float(os.environ.get(STALL_ENV) or Limits().write_stall_timeout_s)
    if "_lp_read_timeout" not in h11_impl.H11Protocol.__dict__:
        _widen_h11(h11_impl.H11Protocol, max_header_bytes)
    for cls in (httptools_impl.HttpToolsProtocol, h11_impl.H11Protocol):
        _patch(cls, timeout_s, max_header_bytes)
        _bound_write_stalls(cls, stall_s)
    return request_id.middleware()

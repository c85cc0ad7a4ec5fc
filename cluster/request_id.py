"""Request ids: the `x-request-id` a client sends (when sane) or one made up, in every log line and
response that concerns the request.

Serve's HTTP proxy already does most of it: its own ASGI middleware takes the request's
`x-request-id` header (making one up when there is none), uses it as Serve's request id (the
`request_id` field of the proxy's, the ingress's and the worker replicas' log lines, propagated
through handle calls) and echoes it in the response's `X-Request-ID`. But it takes the header
as sent: any length up to the header bound, any bytes the parser lets through, straight into
every log line. `SaneRequestIds`, which the proxy callback (`cluster.slow_clients.install`) puts
in front of Serve's middleware, replaces an id that is not sane (`sane`: 1 to `MAX_CHARS`
printable ASCII characters, no spaces) with a fresh one, so what Serve logs and echoes is
bounded and printable. Over gRPC, Serve's proxy does the same with the `request_id` metadata
(gRPC's own rules keep metadata values printable ASCII and bounded) and returns it as the
`request_id` trailing metadata.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Receive, Scope, Send

HEADER = "x-request-id"
MAX_CHARS = 128
_SANE = re.compile(rf"[\x21-\x7e]{{1,{MAX_CHARS}}}")


def sane(value: str | None) -> bool:
    """1 to MAX_CHARS visible ASCII characters: safe in a log line and in a response header."""
    return value is not None and _SANE.fullmatch(value) is not None


def new() -> str:
    """A fresh id (a UUID, Serve's own form)."""
    return str(uuid.uuid4())


def current() -> str:
    """Serve's request id of the request being handled here ("-" outside one): what Serve's log
    lines carry, for the ingress's own."""
    from ray.serve import context

    return context._get_serve_request_context().request_id or "-"


class SaneRequestIds:
    """ASGI middleware for Serve's HTTP proxy: an HTTP request reaches Serve's request-id
    middleware with exactly one sane `x-request-id` (the client's, or a fresh one)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = MutableHeaders(scope=scope)
            sent = headers.getlist(HEADER)
            if len(sent) != 1 or not sane(sent[0]):
                del headers[HEADER]
                headers.append(HEADER, new())
        await self.app(scope, receive, send)


def middleware() -> list[Any]:
    """What the proxy callback returns for Serve to install (a Starlette `Middleware` list)."""
    from starlette.middleware import Middleware

    return [Middleware(SaneRequestIds)]

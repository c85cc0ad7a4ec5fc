"""Request ids over HTTP: the proxy callback's middleware in front of Serve's own request-id
middleware, stacked the way Serve's HTTP proxy stacks them (`_apply_middlewares`), around an app
that records the id it is handed (what Serve then logs under and passes to the replicas)."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from ray.serve._private.http_util import _apply_middlewares
from starlette.types import Receive, Scope, Send

from cluster import request_id

SEEN: list[list[str]] = []


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    SEEN.append([v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"])
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def call(headers: list[tuple[bytes, bytes]]) -> tuple[list[str], list[str]]:
    """(the ids the app was handed, the response's x-request-id headers)."""
    proxy = _apply_middlewares(app, request_id.middleware())

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://t") as c:
            return await c.get("/v1/models", headers=headers)

    SEEN.clear()
    r = asyncio.run(go())
    (handed,) = SEEN
    return handed, r.headers.get_list("x-request-id")


def test_a_sane_client_id_is_kept_and_echoed_once() -> None:
    for sent in ("abc-123", "trace:7f/" + "x" * 119, "~!#$%&'*+.^_`|"):
        assert call([(b"x-request-id", sent.encode())]) == ([sent], [sent])


def test_no_id_gets_a_fresh_one() -> None:
    handed, echoed = call([])
    assert len(handed) == 1 and echoed == handed
    uuid.UUID(handed[0])


@pytest.mark.parametrize(
    "headers",
    [
        [(b"x-request-id", b"x" * (request_id.MAX_CHARS + 1))],  # too long for a log line
        [(b"x-request-id", b"two words")],
        [(b"x-request-id", "caf\u00e9".encode("latin-1"))],  # not ASCII
        [(b"x-request-id", b"")],
        [(b"x-request-id", b"a"), (b"x-request-id", b"b")],  # which one?
    ],
)
def test_an_insane_id_is_replaced(headers: list[tuple[bytes, bytes]]) -> None:
    handed, echoed = call(headers)
    assert len(handed) == 1 and echoed == handed
    uuid.UUID(handed[0])
    assert handed[0].encode() not in [v for _, v in headers]


def test_sane() -> None:
    assert request_id.sane("a" * request_id.MAX_CHARS) and not request_id.sane("a" * (request_id.MAX_CHARS + 1))
    assert not request_id.sane(None) and not request_id.sane("tab\there") and not request_id.sane("nl\n")

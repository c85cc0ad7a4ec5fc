"""Strict JSON on the HTTP wire: responses, server-sent events and the one error response."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from cluster.errors import Status, error_body

# Stands in for -inf / +inf if one ever reaches the wire (the engine floors logprobs the same way).
_FLOOR = 9999.0


def _finite(obj: object) -> object:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else math.copysign(_FLOOR, obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: object) -> str:
    """Strict JSON: never NaN/Infinity (those are not JSON); a non-finite float is mapped first."""
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"))


class StrictJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


# A large response goes out in pieces of about this size (cluster.openai.adapter decides "large").
CHUNK_BYTES = 1 << 16


def json_chunks(
    head: Mapping[str, object],
    key: str,
    items: Iterable[object],
    tail: Callable[[], Mapping[str, object]],
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[bytes]:
    """``dumps({**head, key: list(items), **tail()})`` as UTF-8, in pieces of about chunk_bytes,
    the same bytes; only the item being encoded and one piece are held at a time (``tail`` is
    built last, once the items are out)."""
    start = dumps(head)
    parts = [f"{start[:-1]}{',' if head else ''}{json.dumps(key)}:["]
    size = len(parts[0])
    for n, item in enumerate(items):
        text = ("," if n else "") + dumps(item)
        parts.append(text)
        size += len(text)
        if size >= chunk_bytes:
            yield "".join(parts).encode("utf-8")
            parts, size = [], 0
    end = dumps(tail())
    parts.append("]" + (f",{end[1:]}" if end != "{}" else "}"))
    yield "".join(parts).encode("utf-8")


class StreamedJSONResponse(StreamingResponse):
    """A large JSON response written as `json_chunks` come (chunked transfer encoding). The
    pieces are produced on a worker thread (Starlette iterates a plain iterator in its pool)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        super().__init__(chunks, media_type="application/json")


def sse(obj: object) -> str:
    return f"data: {dumps(obj)}\n\n"


def status_response(status: Status, headers: dict[str, str] | None = None) -> JSONResponse:
    """Every HTTP error answer: OpenAI's error JSON (cluster.errors.error_body) with its status."""
    return StrictJSONResponse(error_body(status), status_code=status.http, headers=headers)


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def charset(content_type: str) -> str | None:
    """The `charset` parameter of a Content-Type, lower-cased and unquoted; None without one."""
    for param in content_type.split(";")[1:]:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"').lower()
    return None

"""Strict JSON on the HTTP wire: responses, server-sent events and the one error response."""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

from cluster.errors import Status, error_body

# Stands in for -inf / +inf if one ever reaches the wire (the engine floors logprobs the same way).
_FLOOR = 9999.0


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else math.copysign(_FLOOR, obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON: never NaN/Infinity (those are not JSON); a non-finite float is mapped first."""
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"))


class StrictJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def status_response(status: Status, headers: dict[str, str] | None = None) -> JSONResponse:
    """Every HTTP error answer: OpenAI's error JSON (cluster.errors.error_body) with its status."""
    return StrictJSONResponse(error_body(status), status_code=status.http, headers=headers)


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")

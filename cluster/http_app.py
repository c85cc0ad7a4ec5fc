"""The HTTP side of the ingress as a plain FastAPI app: strict JSON out, OpenAI-shaped errors for
everything (the framework's own 404/405/422 included) and an OpenAPI document that declares the
request bodies (the routes read raw bytes so the limits apply before parsing)."""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.errors import Status, classify, error_body
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest

api = FastAPI(title="logitpool", description="OpenAI-compatible completions over a logitpool worker pool")

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
    return StrictJSONResponse(error_body(status), status_code=status.http, headers=headers)


# Errors raised by the framework itself (unknown path, wrong method, ...) get the same JSON shape.
@api.exception_handler(StarletteHTTPException)
async def _framework_error(request: Request, exc: StarletteHTTPException) -> Response:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return status_response(Status(exc.status_code, grpc.StatusCode.UNKNOWN, message, kind),
                            headers=getattr(exc, "headers", None))


@api.exception_handler(RequestValidationError)
async def _request_validation_error(request: Request, exc: RequestValidationError) -> Response:
    return status_response(classify(ValueError(str(exc.errors()[:3]))))


@api.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> Response:
    return status_response(classify(exc))


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "code", "param"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "code": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    }},
}


def _openapi() -> dict[str, Any]:
    """FastAPI's document plus the request bodies (the routes read raw bytes, see _parse)."""
    if api.openapi_schema:
        return api.openapi_schema
    schema = get_openapi(title=api.title, version="1.0.0", description=api.description, routes=api.routes)
    bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    _, defs = models_json_schema([(m, "validation") for m in bodies.values()],
                                 ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path, model in bodies.items():
        op = schema["paths"][path]["post"]
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
        # `"stream": true` answers server-sent events instead of one JSON object.
        op["responses"]["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    # Prometheus' text format, not JSON.
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    # /health answers 503 with its own body (how many replicas are alive), not an error object.
    health = {"type": "object", "required": ["status"], "properties": {
        "status": {"type": "string"}, "workers_alive": {"type": "integer"}, "workers": {"type": "integer"}}}
    for code in ("200", "503"):
        schema["paths"]["/health"]["get"]["responses"][code] = {
            "description": "Health of the worker pool", "content": {"application/json": {"schema": health}}}
    schema["components"]["schemas"]["ErrorResponse"] = _ERROR_SCHEMA
    error = {"description": "Error (OpenAI's shape)",
             "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for methods in schema["paths"].values():
        for op in methods.values():
            op.setdefault("responses", {})["default"] = error
    api.openapi_schema = schema
    return schema


api.openapi = _openapi  # type: ignore[method-assign]

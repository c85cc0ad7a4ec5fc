"""The HTTP routes of the ingress as a plain FastAPI app built around an `HttpAdapter`: strict
JSON out, OpenAI-shaped errors for everything (the framework's own 404/405/422 included) and an
OpenAPI document that declares the request bodies (the routes read raw bytes so the limits apply
before parsing)."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.errors import Status, classify
from cluster.openai.adapter import HttpAdapter
from cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from cluster.openai.responses import ResponsesRequest
from cluster.openai.wire import status_response

TITLE = "logitpool"
DESCRIPTION = "OpenAI-compatible completions over a logitpool worker pool"


def build_api(http: HttpAdapter) -> FastAPI:
    """The FastAPI app serving `http` (Serve calls this on each ingress replica)."""
    api = FastAPI(title=TITLE, description=DESCRIPTION)
    api.post("/v1/completions")(http.completions)
    api.post("/v1/chat/completions")(http.chat_completions)
    api.post("/v1/responses")(http.responses)
    # Nothing is stored: retrieve, delete, input_items and cancel (a POST, left out of the document) all 404.
    api.api_route("/v1/responses/{response_id:path}", methods=["GET", "DELETE"])(http.retrieve_response)
    api.post("/v1/responses/{response_id:path}", include_in_schema=False)(http.retrieve_response)
    api.get("/v1/models")(http.models)
    api.get("/v1/models/{model:path}")(http.model)
    api.post("/tokenize")(http.tokenize)
    api.post("/detokenize")(http.detokenize)
    api.get("/v1/processors")(http.list_processors)
    api.get("/health")(http.health)
    api.get("/metrics")(http.prometheus)

    # Errors raised by the framework itself (unknown path, wrong method, ...) get the same JSON shape.
    @api.exception_handler(StarletteHTTPException)
    async def _framework_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return status_response(
            Status(exc.status_code, grpc.StatusCode.UNKNOWN, message, kind), headers=getattr(exc, "headers", None)
        )

    @api.exception_handler(RequestValidationError)
    async def _request_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return status_response(classify(ValueError(str(exc.errors()[:3]))))

    @api.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception) -> Response:
        return status_response(classify(exc))

    api.openapi = lambda: _openapi(api)  # type: ignore[method-assign]  # FastAPI's documented way to extend it
    return api


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code", "param"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}


def _openapi(api: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the request bodies (the routes read raw bytes, see _parse)."""
    if api.openapi_schema:
        return api.openapi_schema
    schema = get_openapi(title=api.title, version="1.0.0", description=api.description, routes=api.routes)
    bodies: dict[str, tuple[type[BaseModel], ...]] = {
        "/v1/completions": (CompletionRequest,),
        "/v1/chat/completions": (ChatCompletionRequest,),
        "/v1/responses": (ResponsesRequest,),
        "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),  # chat when `messages` is there
        "/detokenize": (DetokenizeRequest,),
    }
    _, defs = models_json_schema(
        [(m, "validation") for ms in bodies.values() for m in ms], ref_template="#/components/schemas/{model}"
    )
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path, models in bodies.items():
        refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
        op = schema["paths"][path]["post"]
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}},
        }
    for path in ("/v1/completions", "/v1/chat/completions"):
        # `"stream": true` answers server-sent events instead of one JSON object.
        sse_body = {"schema": {"type": "string"}}
        schema["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"] = sse_body
    # /v1/responses names each event (OpenAI's `event:` line); its data is one JSON object.
    named = {"type": "string", "contentMediaType": "application/json"}
    event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"type": "string"}, "data": named},
    }
    schema["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"] = {"schema": event}
    # Prometheus' text format, not JSON.
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    # /health answers 503 with its own body (how many replicas are alive), not an error object.
    health = {
        "type": "object",
        "required": ["status"],
        "properties": {
            "status": {"type": "string"},
            "workers_alive": {"type": "integer"},
            "workers": {"type": "integer"},
        },
    }
    for code in ("200", "503"):
        schema["paths"]["/health"]["get"]["responses"][code] = {
            "description": "Health of the worker pool",
            "content": {"application/json": {"schema": health}},
        }
    schema["components"]["schemas"]["ErrorResponse"] = _ERROR_SCHEMA
    error = {
        "description": "Error (OpenAI's shape)",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    for methods in schema["paths"].values():
        for op in methods.values():
            op.setdefault("responses", {})["default"] = error
    api.openapi_schema = schema
    return schema

"""Errors map to status codes here, and only here (HTTP and gRPC alike). No tracebacks leak."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import grpc
from pydantic import ValidationError
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from cluster import request_id
from cluster.auth import Unauthenticated
from worker.async_engine import EngineDeadError

logger = logging.getLogger(__name__)


class ModelNotFound(Exception):
    """A request named a model this server does not serve (404, as vLLM answers)."""

    def __init__(self, model: str) -> None:
        super().__init__(f"model: the model `{model[:200]}` does not exist")


class ResponseTooLarge(Exception):
    """A response message larger than Serve's gRPC proxy sends (limits.max_grpc_message_bytes)."""


class RequestFailed(Exception):
    """The engine ended a request with finish_reason `error` (e.g. a processor raised)."""


@dataclass(frozen=True)
class Status:
    http: int
    grpc: grpc.StatusCode
    message: str
    kind: str


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        # A model-level check's message names its own field ("suffix: ..."); pydantic prefixes it.
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")).removeprefix("Value error, "))
    return "; ".join(parts)


_UNAVAILABLE = (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError, EngineDeadError)


def replica_unavailable(exc: BaseException) -> bool:
    """The worker replica cannot serve (dead actor or dead engine): another replica may."""
    if isinstance(exc, RayTaskError) and getattr(exc, "cause", None) is not None:
        exc = exc.cause
    return isinstance(exc, _UNAVAILABLE)


def classify(exc: BaseException) -> Status:
    if isinstance(exc, RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else None
        if cause is not None and not isinstance(cause, RayTaskError):
            return classify(cause)
    if isinstance(exc, Unauthenticated):
        return Status(401, grpc.StatusCode.UNAUTHENTICATED, str(exc), "authentication_error")
    if isinstance(exc, ModelNotFound):
        return Status(404, grpc.StatusCode.NOT_FOUND, str(exc), "NotFoundError")
    if isinstance(exc, ResponseTooLarge):
        return Status(413, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "invalid_request_error")
    if isinstance(exc, ValidationError):
        return Status(400, grpc.StatusCode.INVALID_ARGUMENT, _validation_message(exc), "invalid_request_error")
    if isinstance(exc, ValueError):  # 400 unless it says otherwise (cluster.limits.RequestRejected)
        return Status(
            getattr(exc, "http_status", 400), grpc.StatusCode.INVALID_ARGUMENT, str(exc), "invalid_request_error"
        )
    if isinstance(exc, BackPressureError):
        return Status(503, grpc.StatusCode.RESOURCE_EXHAUSTED, "server overloaded, retry later", "overloaded")
    if isinstance(exc, _UNAVAILABLE):
        return Status(503, grpc.StatusCode.UNAVAILABLE, "worker unavailable, retry", "unavailable")
    if isinstance(exc, TimeoutError):
        return Status(504, grpc.StatusCode.DEADLINE_EXCEEDED, "request timed out", "timeout")
    if isinstance(exc, RequestFailed):
        return Status(500, grpc.StatusCode.INTERNAL, str(exc), "request_failed")
    logger.exception("unexpected error (x-request-id %s)", request_id.current(), exc_info=exc)
    return Status(500, grpc.StatusCode.INTERNAL, "internal error", "internal_error")


_PARAM = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


def error_param(message: str) -> str | None:
    """The field an error message names first (``"n: ..."``), None when it names none."""
    m = _PARAM.match(message)
    return m.group(1) if m and m.group(1) not in ("body", "request") else None


def error_body(status: Status) -> dict[str, Any]:
    """OpenAI's error shape; `param` is the field the message names (error_param)."""
    return {
        "error": {
            "message": status.message,
            "type": status.kind,
            "code": status.http,
            "param": error_param(status.message),
        }
    }

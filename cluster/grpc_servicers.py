"""The servicer functions Serve's gRPC proxy registers (`grpc_options.grpc_servicer_functions`).

They register the generated handlers with three changes, all in Serve's proxy process:

- The request deserializer does not parse: it wraps the message bytes in a `WireRequest`, which
  the proxy forwards to the ingress as it is. The ingress checks the API key and the size first
  and parses after (cluster.rpc.service), so a caller without a key never gets a message parsed,
  and a malformed one (garbage, invalid UTF-8, nesting past protobuf's recursion limit) is
  INVALID_ARGUMENT, not the UNKNOWN with Python class names that Serve's parse failure gives.
- A call Serve itself fails (a replica gone mid-call) ends with its code but never with Serve's
  details (a traceback, pid, actor id): ours are one line, so more than one line is Serve's.
- A rejected call (`GrpcRejected`) is one line in Serve's logs, not a traceback at ERROR.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2_grpc

from client.pb.logitpool.v1 import logitpool_pb2_grpc

M = TypeVar("M", bound=Message)
# Serve's logger: the proxy's and the replicas' "Request failed" records go through it.
SERVE_LOGGER = "ray.serve"
# gRPC codes that mean the client's call was refused, not that the server failed.
CLIENT_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.CANCELLED,
    }
)


class WireRequest:
    """A request message as received: its type's full name and its bytes, parsed on demand."""

    def __init__(self, message_type: str, raw: bytes) -> None:
        self.message_type = message_type
        self.raw = raw

    def parse(self, cls: type[M]) -> M:
        """The message; ValueError naming the type when the bytes are not one."""
        try:
            if cls.DESCRIPTOR.full_name != self.message_type:
                raise TypeError(self.message_type)
            return cls.FromString(self.raw)
        except Exception:  # noqa: BLE001 - any parse failure is the client's malformed message
            raise ValueError(f"request: not a valid {cls.DESCRIPTOR.full_name} message") from None


class GrpcRejected(Exception):
    """A call the ingress answered with `code` (set on the context, for Serve to end the call)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)  # the arguments again: it is unpickled in Serve's proxy
        self.code = code
        self.details = details

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


def one_line(details: str) -> str:
    """Status details as this server sends them: one line (see `_sanitized`), bounded."""
    return " ".join(details.split("\n"))[:2000]


# -- rejections as one log line --------------------------------------------------------------


def _rejection(exc: BaseException | None) -> GrpcRejected | None:
    """The GrpcRejected inside Serve's wrappers (RayTaskError, gRPCStatusError), if any."""
    for _ in range(4):
        if exc is None or isinstance(exc, GrpcRejected):
            return exc
        exc = getattr(exc, "original_exception", None) or getattr(exc, "cause", None)
    return None


class _OneLineRejections(logging.Filter):
    """Serve logs every failed call with its traceback at ERROR; a rejection becomes one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        rejected = _rejection(record.exc_info[1] if record.exc_info else None)
        if rejected is not None:
            level = logging.INFO if rejected.code in CLIENT_CODES else logging.WARNING
            record.msg, record.args = "gRPC call rejected: %s: %s", (rejected.code.name, rejected.details[:300])
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = level, logging.getLevelName(level)
        return True


def install_rejection_logging() -> None:
    """Idempotent; in each process that logs gRPC calls (Serve's proxy, the ingress replicas)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, _OneLineRejections) for f in logger.filters):
        logger.addFilter(_OneLineRejections())


# -- Serve's proxy server ----------------------------------------------------------------------


def _deferred(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    if parse is None:
        return handler
    descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    message_type = descriptor.full_name if descriptor is not None else "request"
    return handler._replace(request_deserializer=lambda raw: WireRequest(message_type, raw))  # type: ignore[attr-defined]  # a namedtuple at runtime; the stub's class has no _replace


def _clean_details(context: grpc.aio.ServicerContext) -> None:
    code = context.code()
    details = context.details() or ""
    if code not in (None, grpc.StatusCode.OK) and ("\n" in details or "Traceback" in details):
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        context.set_details(f"{name.lower()}: the server failed this call (details are in its log)")


Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def _sanitized(behavior: Behavior) -> Behavior:
    """``behavior`` (one of Serve's per-method entry points) with Serve's own details cleaned."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for message in behavior(request, context):
                    yield message
            finally:
                _clean_details(context)

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        finally:
            _clean_details(context)

    return unary


def _sanitizing(factory: Callable[..., Behavior]) -> Callable[..., Behavior]:
    def make(*args: Any, **kwargs: Any) -> Behavior:
        return _sanitized(factory(*args, **kwargs))

    make.logitpool_sanitizing = True  # type: ignore[attr-defined]  # a marker on the function, read back by getattr
    return make


class _ProxyServer:
    """Wraps the server a generated add_*_to_server function registers on (Serve's
    gRPCGenericServer, whose `service_handler_factory` makes each method's entry point)."""

    def __init__(self, server: Any) -> None:
        self._server = server
        factory = getattr(server, "service_handler_factory", None)
        if callable(factory) and not getattr(factory, "logitpool_sanitizing", False):
            server.service_handler_factory = _sanitizing(factory)
        install_rejection_logging()

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        for h in handlers:
            h._method_handlers = {k: _deferred(v) for k, v in h._method_handlers.items()}
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self._server.add_registered_method_handlers(service, {k: _deferred(v) for k, v in handlers.items()})


def add_LogitPoolServicer_to_server(servicer: Any, server: Any) -> None:
    logitpool_pb2_grpc.add_LogitPoolServicer_to_server(servicer, _ProxyServer(server))


def add_HealthServicer_to_server(servicer: Any, server: Any) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(servicer, _ProxyServer(server))

"""The servicer functions Serve's gRPC proxy registers (`grpc_options.grpc_servicer_functions`).

They register the generated handlers with one change: the request deserializer never raises.
Serve's proxy parses each request before routing it; a parse failure there (garbage bytes,
invalid UTF-8, nesting past protobuf's recursion limit) would end the call with UNKNOWN and
Python class names in the details. Here it becomes a `MalformedRequest`, which reaches the
ingress like any request and is answered INVALID_ARGUMENT (see grpc_service).
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from client.pb.logitpool.v1 import logitpool_pb2_grpc


class MalformedRequest:
    """Stands in for a request message that did not parse."""

    def __init__(self, message_type: str) -> None:
        self.message_type = message_type

    def error(self) -> ValueError:
        return ValueError(f"request: not a valid {self.message_type} message")


def _lenient(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer
    if parse is None:
        return handler
    name = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    message_type = name.full_name if name is not None else "request"

    def deserialize(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception:  # noqa: BLE001 - any parse failure is the client's malformed message
            return MalformedRequest(message_type)

    return handler._replace(request_deserializer=deserialize)


class _LenientServer:
    """Wraps the server a generated add_*_to_server function registers on."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        for h in handlers:
            h._method_handlers = {k: _lenient(v) for k, v in h._method_handlers.items()}
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self._server.add_registered_method_handlers(service, {k: _lenient(v) for k, v in handlers.items()})


def add_LogitPoolServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 - generated name
    logitpool_pb2_grpc.add_LogitPoolServicer_to_server(servicer, _LenientServer(server))


def add_HealthServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802 - generated name
    health_pb2_grpc.add_HealthServicer_to_server(servicer, _LenientServer(server))

"""The exceptions a logitpool call raises, one per gRPC status a caller handles differently.

``error_class`` is the one mapping from ``grpc.StatusCode``; everything else goes through it.
Each error carries the server's message (``str(err)`` / ``err.message``) and the status code.
"""

from __future__ import annotations

import grpc


class LogitpoolError(Exception):
    """Base of every error the client raises for a failed call."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidArgument(LogitpoolError, ValueError):
    """The request was rejected by validation; the message names the field. Never retried."""


class Unavailable(LogitpoolError):
    """No replica could take the call (starting, restarting, unreachable). Safe to retry."""


class ResourceExhausted(LogitpoolError):
    """The pool is overloaded (queues full). Safe to retry after a pause."""


class DeadlineExceeded(LogitpoolError, TimeoutError):
    """The call's deadline (the client's ``timeout``) passed."""


class Unauthenticated(LogitpoolError):
    """Missing or wrong API key, or not permitted."""


class InternalError(LogitpoolError):
    """The server failed in a way that is not the caller's fault."""


_BY_CODE: dict[grpc.StatusCode, type[LogitpoolError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
    grpc.StatusCode.DATA_LOSS: InternalError,
}


def error_class(code: grpc.StatusCode) -> type[LogitpoolError]:
    """The exception class for a status code; codes without their own class map to the base."""
    return _BY_CODE.get(code, LogitpoolError)


def from_rpc_error(err: grpc.RpcError) -> LogitpoolError:
    """Convert a failed call (sync or grpc.aio) into the matching LogitpoolError."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else None
    code = code or grpc.StatusCode.UNKNOWN
    return error_class(code)(details or code.name, code)

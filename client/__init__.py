"""logitpool's gRPC client library. Depends on grpcio and protobuf only (never torch or ray).

Usage:

    from client import Client
    with Client("localhost:9000", api_key="...", application="logitpool") as c:
        c.generate("Hello", max_tokens=8, temperature=0.0, extra_args={"target_token": 67})
"""

from client.aio import AsyncClient, AsyncStream
from client.convert import extra_args_from_pb, json_from_pb, json_to_pb
from client.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    LogitpoolError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    error_class,
    from_rpc_error,
)
from client.sync import Client, Stream
from client.types import Choice, Chunk, Completion, Logprob, ProcessorInfo, TokenLogprobs, Usage

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Choice",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "InternalError",
    "InvalidArgument",
    "LogitpoolError",
    "Logprob",
    "ProcessorInfo",
    "ResourceExhausted",
    "Stream",
    "TokenLogprobs",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "error_class",
    "extra_args_from_pb",
    "from_rpc_error",
    "json_from_pb",
    "json_to_pb",
]

"""Client: the blocking gRPC client of a logitpool deployment.

Usage:

    with Client("localhost:9000", api_key="...") as c:
        print(c.generate("Hello", max_tokens=8, extra_args={"target_token": 67}).text)
        with c.stream("Hello", max_tokens=8) as s:
            for chunk in s:
                print(chunk.text, end="")
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from client import convert
from client._retry import Deadline, RetryPolicy, check_timeout
from client.errors import DeadlineExceeded, LogitpoolError, Unavailable, from_rpc_error
from client.pb.logitpool.v1 import logitpool_pb2 as pb
from client.pb.logitpool.v1 import logitpool_pb2_grpc
from client.types import Chunk, Completion, ProcessorInfo

T = TypeVar("T")


class _StreamCall(Protocol):
    """A running GenerateStream call, as grpc returns it: its messages, and cancel()."""

    def __next__(self) -> pb.GenerateStreamResponse: ...

    def cancel(self) -> bool: ...


class Client:
    """Blocking client; thread-safe, one channel per client. ``timeout`` bounds every call,
    retries included (a stream's timeout covers the whole stream). Use as a context manager."""

    def __init__(
        self,
        target: str,
        api_key: str | None = None,
        timeout: float = 30.0,
        *,
        application: str | None = None,
        max_retries: int = 3,
        backoff: float = 0.1,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._timeout = check_timeout(timeout)
        self._retry = RetryPolicy(max_retries, backoff)
        self._metadata = convert.call_metadata(api_key, application)
        options = list(channel_options)
        self._channel = (
            grpc.secure_channel(target, credentials, options)
            if credentials is not None
            else grpc.insecure_channel(target, options)
        )
        self._stub = logitpool_pb2_grpc.LogitPoolStub(self._channel)
        self._health: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(
            convert.HEALTH_CHECK_METHOD
        )  # bytes in, bytes out

    # -- calls ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str | None = None,
        model: str | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
        **sampling: Any,
    ) -> Completion:
        """Generate all completions of one request. ``sampling``: SamplingParams' field names;
        ``add_special_tokens``: whether a text prompt gets the tokenizer's BOS (server default: yes)."""
        request = convert.generate_request(
            prompt, sampling, request_id=request_id, model=model, add_special_tokens=add_special_tokens
        )
        response = self._unary(self._stub.Generate, request, timeout)
        return convert.completion_from_pb(response)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        request_id: str | None = None,
        model: str | None = None,
        add_special_tokens: bool | None = None,
        timeout: float | None = None,
        **sampling: Any,
    ) -> Stream:
        """Stream chunks as tokens are sampled. The call starts on first iteration;
        ``close()`` (or leaving a ``with`` block) cancels it on the server."""
        request = convert.generate_request(
            prompt, sampling, request_id=request_id, model=model, add_special_tokens=add_special_tokens
        )

        def start(remaining: float) -> _StreamCall:
            return self._stub.GenerateStream(request, timeout=remaining, metadata=self._metadata)

        return Stream(start, self._seconds(timeout), self._retry)

    def processors(self, *, timeout: float | None = None) -> list[ProcessorInfo]:
        """The logits processors the workers loaded, and the extra_args each reads."""
        response = self._unary(self._stub.ListProcessors, convert.list_processors_request(), timeout)
        return convert.processors_from_pb(response)

    def health(self, service: str = "", *, timeout: float | None = None) -> bool:
        """grpc.health.v1 Check: True when SERVING; False when not serving or not reachable."""
        try:
            raw = self._health(convert.health_request(service), timeout=self._seconds(timeout), metadata=self._metadata)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            if isinstance(err, (Unavailable, DeadlineExceeded)) or err.code == grpc.StatusCode.NOT_FOUND:
                return False
            raise err from exc
        return convert.health_is_serving(raw)

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _seconds(self, timeout: float | None) -> float:
        return self._timeout if timeout is None else check_timeout(timeout)

    def _unary(self, rpc: Callable[..., T], request: Message, timeout: float | None) -> T:
        deadline = Deadline.after(self._seconds(timeout))
        retries = 0
        while True:
            try:
                return rpc(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                wait = self._retry.wait_before_retry(retries, err, deadline.at - time.monotonic())
                if wait is None:
                    raise err from exc
            time.sleep(wait)
            retries += 1


class Stream(Iterator[Chunk]):
    """An iterator of Chunks over one GenerateStream call, retried only before the first message.

    ``close()`` cancels the call; so does leaving a ``with`` block or dropping the stream.
    """

    def __init__(self, start: Callable[[float], _StreamCall], timeout: float, retry: RetryPolicy) -> None:
        self._start = start
        self._timeout = timeout
        self._retry = retry
        self._deadline: Deadline | None = None
        self._call: _StreamCall | None = None
        self._pending: deque[Chunk] = deque()
        self._received = False
        self._retries = 0
        self._done = False
        self._closed = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        while not self._pending:
            if self._done:
                raise StopIteration
            self._pending.extend(self._receive())
        return self._pending.popleft()

    def _receive(self) -> list[Chunk]:
        """The chunks of the next message ([] at the end), starting or restarting the call."""
        deadline = self._deadline = self._deadline or Deadline.after(self._timeout)
        while not self._closed:
            try:
                if self._call is None:
                    self._call = self._start(deadline.remaining())
                message = next(self._call)
            except StopIteration:
                self._done, self._call = True, None
                return []
            except grpc.RpcError as exc:
                self._call = None
                if self._closed:  # our own cancel() surfacing in a concurrent next()
                    return []
                err = from_rpc_error(exc)
                wait = None
                if not self._received:
                    wait = self._retry.wait_before_retry(self._retries, err, deadline.at - time.monotonic())
                if wait is None:
                    self._done = True
                    raise err from exc
            except LogitpoolError:  # the deadline passed before a (re)start
                self._done = True
                raise
            else:
                self._received = True
                return convert.chunks_from_pb(message)
            time.sleep(wait)
            self._retries += 1
        return []

    def close(self) -> None:
        """Stop iterating and cancel the call on the server (idempotent)."""
        self._closed = True
        self._done = True
        self._pending.clear()
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None:
            self.close()

"""AsyncClient: the asyncio (grpc.aio) client; the same surface as Client, awaited.

    async with AsyncClient("localhost:9000") as c:
        completion = await c.generate("Hello", max_tokens=8)
        async with c.stream("Hello", max_tokens=8) as s:
            async for chunk in s:
                print(chunk.text, end="")

Create it inside the event loop that will use it (grpc.aio channels belong to one loop).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc
import grpc.aio
from google.protobuf.message import Message

from client import convert
from client._retry import Deadline, RetryPolicy, check_timeout
from client.errors import DeadlineExceeded, LogitpoolError, Unavailable, from_rpc_error
from client.pb.logitpool.v1 import logitpool_pb2 as pb
from client.pb.logitpool.v1 import logitpool_pb2_grpc
from client.types import Chunk, Completion, ProcessorInfo

T = TypeVar("T")
_StreamCall = grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateStreamResponse]


class AsyncClient:
    """Asyncio client. ``timeout`` bounds every call, retries included (a stream's timeout
    covers the whole stream). Use as an async context manager or ``await close()``."""

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
            grpc.aio.secure_channel(target, credentials, options)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options)
        )
        self._stub = logitpool_pb2_grpc.LogitPoolStub(self._channel)
        self._health: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self._channel.unary_unary(
            convert.HEALTH_CHECK_METHOD
        )  # bytes in, bytes out

    # -- calls ---------------------------------------------------------------------------

    async def generate(
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
        response = await self._unary(self._stub.Generate, request, timeout)
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
    ) -> AsyncStream:
        """Stream chunks as tokens are sampled. The call starts on first iteration; ``aclose()``,
        leaving an ``async with`` block or dropping the stream cancels it on the server."""
        request = convert.generate_request(
            prompt, sampling, request_id=request_id, model=model, add_special_tokens=add_special_tokens
        )

        def start(remaining: float) -> _StreamCall:
            return self._stub.GenerateStream(request, timeout=remaining, metadata=self._metadata)

        return AsyncStream(start, self._seconds(timeout), self._retry)

    async def processors(self, *, timeout: float | None = None) -> list[ProcessorInfo]:
        """The logits processors the workers loaded, and the extra_args each reads."""
        response = await self._unary(self._stub.ListProcessors, convert.list_processors_request(), timeout)
        return convert.processors_from_pb(response)

    async def health(self, service: str = "", *, timeout: float | None = None) -> bool:
        """grpc.health.v1 Check: True when SERVING; False when not serving or not reachable."""
        try:
            raw = await self._health(
                convert.health_request(service), timeout=self._seconds(timeout), metadata=self._metadata
            )
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            if isinstance(err, (Unavailable, DeadlineExceeded)) or err.code == grpc.StatusCode.NOT_FOUND:
                return False
            raise err from exc
        return convert.health_is_serving(raw)

    # -- lifecycle -----------------------------------------------------------------------

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals -----------------------------------------------------------------------

    def _seconds(self, timeout: float | None) -> float:
        return self._timeout if timeout is None else check_timeout(timeout)

    async def _unary(self, rpc: Callable[..., Awaitable[T]], request: Message, timeout: float | None) -> T:
        deadline = Deadline.after(self._seconds(timeout))
        retries = 0
        while True:
            try:
                return await rpc(request, timeout=deadline.remaining(), metadata=self._metadata)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                wait = self._retry.wait_before_retry(retries, err, deadline.at - time.monotonic())
                if wait is None:
                    raise err from exc
            await asyncio.sleep(wait)
            retries += 1


class AsyncStream(AsyncIterator[Chunk]):
    """An async iterator of Chunks over one GenerateStream call, retried only before the first
    message. ``aclose()``/``cancel()`` cancel the call; so does leaving ``async with`` or
    dropping the stream."""

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

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            self._pending.extend(await self._receive())
        return self._pending.popleft()

    async def _receive(self) -> list[Chunk]:
        """The chunks of the next message ([] at the end), starting or restarting the call."""
        deadline = self._deadline = self._deadline or Deadline.after(self._timeout)
        while not self._closed:
            try:
                if self._call is None:
                    self._call = self._start(deadline.remaining())
                message = await self._call.read()
            except asyncio.CancelledError:
                if self._closed:  # our own cancel() surfacing in a concurrent read()
                    return []
                self.cancel()  # the awaiting task was cancelled: end the RPC too
                raise
            except grpc.RpcError as exc:
                self._call = None
                if self._closed:
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
                if message is grpc.aio.EOF:
                    self._done, self._call = True, None
                    return []
                self._received = True
                return convert.chunks_from_pb(cast(pb.GenerateStreamResponse, message))  # not EOF: a message
            await asyncio.sleep(wait)
            self._retries += 1
        return []

    def cancel(self) -> None:
        """Stop iterating and cancel the call on the server (idempotent, callable without await)."""
        self._closed = True
        self._done = True
        self._pending.clear()
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()

    def __del__(self) -> None:
        if getattr(self, "_call", None) is not None:
            self.cancel()

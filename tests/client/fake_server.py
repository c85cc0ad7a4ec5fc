"""A deterministic in-process LogitPool server for the client tests.

The servicer echoes: choice ``i`` of a request emits the prompt's token ids cyclically, each plus
``i``, for ``max_tokens`` steps (default 4); the text of token t is ``"<t>"``. It records every
request, its metadata and its decoded extra_args, can fail the next calls with given status
codes (before or after some streamed messages), can wait between messages, and sets
``cancelled`` when a call ends before the servicer finished it (client cancellation or deadline).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client import extra_args_from_pb
from client.pb.logitpool.v1 import logitpool_pb2 as pb
from client.pb.logitpool.v1 import logitpool_pb2_grpc

DEFAULT_MAX_TOKENS = 4

PROCESSORS = (
    pb.ProcessorInfo(name="min_p", fqcn="worker.logits_processor.builtin:MinPLogitsProcessor", argmax_invariant=True),
    pb.ProcessorInfo(
        name="force_token",
        fqcn="tests.fixtures:ForceToken",
        argmax_invariant=False,
        extra_args_keys=["target_token"],
        extra_args_schema_json='{"type": "object", "properties": {"target_token": {"type": "integer"}}}',
    ),
)


@dataclass(frozen=True)
class Failure:
    code: grpc.StatusCode
    message: str
    after_messages: int = 0  # streams: messages sent before failing


@dataclass
class FakeLogitPool(logitpool_pb2_grpc.LogitPoolServicer):
    delay: float = 0.0  # seconds before a unary reply and between streamed messages
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    extra_args: list[dict[str, Any]] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)
    failures: deque[Failure] = field(default_factory=deque)
    cancelled: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, code: grpc.StatusCode, message: str = "injected", times: int = 1, after_messages: int = 0) -> None:
        """The next ``times`` calls fail with ``code`` and ``message``."""
        self.failures.extend([Failure(code, message, after_messages)] * times)

    # -- LogitPool -----------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        call = self._begin("Generate", request, context)
        if call.failure is not None:
            call.abort(context)
        if self.delay and call.ended.wait(self.delay):
            return pb.GenerateResponse()  # the client is gone; nobody reads this
        choices = _choices(request)
        completions = [
            pb.Completion(
                index=i,
                text="".join(_text(t) for t in tokens),
                token_ids=tokens,
                finish_reason="length",
                cumulative_logprob=sum(_logprob(k) for k in range(len(tokens))),
                logprobs=[_position(t, k, request) for k, t in enumerate(tokens)] if _wants_logprobs(request) else [],
            )
            for i, tokens in enumerate(choices)
        ]
        call.finished = True
        return pb.GenerateResponse(
            request_id=_request_id(request), completions=completions, usage=_usage(request, choices)
        )

    def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        call = self._begin("GenerateStream", request, context)
        choices = _choices(request)
        steps = len(choices[0])
        for step in range(steps):
            if step and self.delay and call.ended.wait(self.delay):
                return
            if call.failure is not None and step == call.failure.after_messages:
                call.abort(context)
            last = step == steps - 1
            deltas = [
                pb.CompletionDelta(
                    index=i,
                    text=_text(tokens[step]),
                    token_ids=[tokens[step]],
                    logprobs=[_position(tokens[step], step, request)] if _wants_logprobs(request) else [],
                    finish_reason="length" if last else "",
                )
                for i, tokens in enumerate(choices)
            ]
            message = pb.GenerateStreamResponse(request_id=_request_id(request), deltas=deltas)
            if last:
                message.usage.CopyFrom(_usage(request, choices))
                call.finished = True
            yield message

    def ListProcessors(
        self, request: pb.ListProcessorsRequest, context: grpc.ServicerContext
    ) -> pb.ListProcessorsResponse:
        call = self._begin("ListProcessors", None, context)
        if call.failure is not None:
            call.abort(context)
        call.finished = True
        return pb.ListProcessorsResponse(processors=PROCESSORS)

    # -- bookkeeping ---------------------------------------------------------------------

    def _begin(self, method: str, request: pb.GenerateRequest | None, context: grpc.ServicerContext) -> _Call:
        with self._lock:
            self.calls[method] += 1
            self.metadata.append(dict(context.invocation_metadata()))
            if request is not None:
                self.requests.append(request)
                self.extra_args.append(extra_args_from_pb(request.params.extra_args))
            call = _Call(self.failures.popleft() if self.failures else None)

        def on_end() -> None:
            # Runs when the RPC terminates for any reason. grpc may drop a streaming handler
            # without resuming it once the client is gone, so this is where cancellation
            # (or a passed deadline) is observed reliably.
            call.ended.set()
            if not call.finished:
                self.cancelled.set()

        context.add_callback(on_end)
        return call


@dataclass
class _Call:
    """One RPC as the servicer sees it."""

    failure: Failure | None
    ended: threading.Event = field(default_factory=threading.Event)
    finished: bool = False  # the servicer ended it (reply, last message or injected failure)

    def abort(self, context: grpc.ServicerContext) -> None:
        assert self.failure is not None
        self.finished = True
        context.abort(self.failure.code, self.failure.message)


def _prompt_ids(request: pb.GenerateRequest) -> list[int]:
    if request.WhichOneof("input") == "prompt_token_ids":
        return list(request.prompt_token_ids.ids) or [0]
    return [ord(c) for c in request.prompt] or [0]


def _choices(request: pb.GenerateRequest) -> list[list[int]]:
    params = request.params
    n = params.n if params.HasField("n") else 1
    steps = params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    prompt = _prompt_ids(request)
    return [[prompt[k % len(prompt)] + i for k in range(steps)] for i in range(n)]


def _text(token: int) -> str:
    return f"<{token}>"


def _logprob(step: int) -> float:
    return -0.5 * (step % 4)  # exact in float32


def _wants_logprobs(request: pb.GenerateRequest) -> bool:
    return request.params.HasField("logprobs")


def _position(token: int, step: int, request: pb.GenerateRequest) -> pb.PositionLogprobs:
    top = [
        pb.TopLogprob(token_id=token + j, logprob=-float(j), rank=j + 1, token=_text(token + j))
        for j in range(request.params.logprobs)
    ]
    return pb.PositionLogprobs(token_id=token, logprob=_logprob(step), rank=1, token=_text(token), top=top)


def _usage(request: pb.GenerateRequest, choices: list[list[int]]) -> pb.Usage:
    prompt = len(_prompt_ids(request))
    completion = sum(len(c) for c in choices)
    return pb.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _request_id(request: pb.GenerateRequest) -> str:
    return request.request_id if request.HasField("request_id") else "fake-1"


@dataclass
class Running:
    target: str
    servicer: FakeLogitPool
    health: health.HealthServicer

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)


@contextmanager
def serve(servicer: FakeLogitPool | None = None) -> Iterator[Running]:
    """Run a LogitPool + Health server on a free loopback port for the duration of the block."""
    servicer = servicer or FakeLogitPool()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    logitpool_pb2_grpc.add_LogitPoolServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    running = Running(f"127.0.0.1:{port}", servicer, health_servicer)
    running.set_serving(True)
    try:
        yield running
    finally:
        server.stop(grace=None).wait()

"""The gRPC side of the front end: protobuf in and out around a `Frontend` (the ingress's
gRPC methods, which Serve's native gRPC proxy maps /Service/Method to, delegate here).

Requests arrive as `WireRequest`s (unparsed bytes, cluster.grpc_servicers): the API key and the
size are checked before the message is parsed. Status codes are set on ``grpc_context`` and a
`GrpcRejected` raised: Serve then ends the call with that code (returning normally after
set_code would end a stream with OK, truncated) and logs it as one line.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from ray.serve.grpc_util import RayServegRPCContext

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster.errors import ResponseTooLarge, classify
from cluster.frontend import Frontend
from cluster.grpc_servicers import GrpcRejected, WireRequest, install_rejection_logging, one_line
from cluster.limits import PayloadTooLarge
from cluster.rpc.convert import (
    delta_pb,
    processors_pb,
    prompt_from_pb,
    prompt_tokens_from_pb,
    response_pb,
    sampling_params_from_pb,
)
from worker.outputs import OutputAccumulator
from worker.request import Scheduling
from worker.sampling_params import SamplingParams

M = TypeVar("M", bound=Message)
# A request as Serve's proxy forwards it (bytes), or parsed (Serve's local testing mode).
Request: TypeAlias = WireRequest | M


def _authorization(ctx: RayServegRPCContext) -> str | None:
    for key, value in ctx.invocation_metadata() or ():
        if key.lower() == "authorization":
            return value
    return None


# Services the standard health check answers for ("" is the server as a whole).
HEALTH_SERVICES = ("", pb.DESCRIPTOR.services_by_name["LogitPool"].full_name)


def _engine_id(request_id: str) -> str:
    """A client's request_id is for tracing; two clients may send the same one concurrently."""
    return f"{request_id}-{uuid.uuid4().hex[:12]}"


def reject(ctx: RayServegRPCContext, code: grpc.StatusCode, details: str) -> GrpcRejected:
    """Set the call's status; raise the result so that Serve ends the call with it."""
    details = one_line(details)
    ctx.set_code(code)
    ctx.set_details(details)
    return GrpcRejected(code, details)


class GrpcAdapter:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        install_rejection_logging()

    def _fail(self, ctx: RayServegRPCContext, exc: BaseException) -> GrpcRejected:
        if isinstance(exc, GrpcRejected):
            return exc
        status = classify(exc)
        self.frontend.count_error(status, "grpc")
        return reject(ctx, status.grpc, status.message)

    def _message(self, request: Request[M], cls: type[M]) -> M:
        """The parsed request, after its size is checked (a parsed one: Serve's local testing mode)."""
        if not isinstance(request, WireRequest):
            return request
        size, limit = len(request.raw), self.frontend.limits.max_body_bytes
        if size > limit:
            raise PayloadTooLarge(f"request: {size} bytes exceeds limits.max_body_bytes ({limit})")
        return request.parse(cls)

    def _fits(self, msg: M) -> M:
        """A response message within what Serve's proxy sends (limits.max_grpc_message_bytes)."""
        size, limit = msg.ByteSize(), self.frontend.limits.grpc_message_bytes
        if size > limit:
            raise ResponseTooLarge(
                f"response: {size} bytes exceeds limits.max_grpc_message_bytes ({limit}); "
                "use GenerateStream or ask for fewer logprobs"
            )
        return msg

    async def _prepare(
        self, request: Request[pb.GenerateRequest], ctx: RayServegRPCContext
    ) -> tuple[str, list[int], SamplingParams, int]:
        """The HTTP side's order: key, size, parse, model, then the request itself; returns the
        request id, prompt ids, params and the request's priority."""
        self.frontend.authorize(_authorization(ctx))
        msg = self._message(request, pb.GenerateRequest)
        self.frontend.check_model(msg.model if msg.HasField("model") else None)
        params, prompt = sampling_params_from_pb(msg.params), prompt_from_pb(msg)
        ready = await self.frontend.prepare(params, [prompt], tokens=prompt_tokens_from_pb(msg))
        rid = msg.request_id if msg.HasField("request_id") else uuid.uuid4().hex
        return rid, ready.ids, ready.params, msg.priority

    def _scheduling(self, priority: int, ctx: RayServegRPCContext, engine_id: str) -> Scheduling:
        """One group per call, under its API key's tenant (as HTTP)."""
        return self.frontend.scheduling(_authorization(ctx), engine_id, priority)

    async def generate(
        self, request: Request[pb.GenerateRequest], grpc_context: RayServegRPCContext
    ) -> pb.GenerateResponse:
        try:
            rid, ids, params, priority = await self._prepare(request, grpc_context)
            engine_id = _engine_id(rid)
            out = await self.frontend.run(engine_id, ids, params, self._scheduling(priority, grpc_context, engine_id))
            response = self._fits(response_pb(rid, out, self.frontend.decode_token))
        except Exception as exc:  # noqa: BLE001 - _fail maps every failure to its gRPC status
            raise self._fail(grpc_context, exc) from None
        self.frontend.count_ok("grpc", [out])
        return response

    async def generate_stream(
        self, request: Request[pb.GenerateRequest], grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            rid, ids, params, priority = await self._prepare(request, grpc_context)
            engine_id = _engine_id(rid)
            sched = self._scheduling(priority, grpc_context, engine_id)
        except Exception as exc:  # noqa: BLE001 - _fail maps every failure to its gRPC status
            raise self._fail(grpc_context, exc) from None
        acc = OutputAccumulator()
        try:
            async for delta in self.frontend.stream_deltas(engine_id, ids, params, sched):
                total = acc.add(delta)
                if delta.finished:
                    total.prompt_token_ids = ids  # deltas arrive without the prompt
                yield self._fits(
                    delta_pb(
                        rid,
                        delta,
                        self.frontend.decode_token,
                        usage=total if delta.finished else None,
                        prompt_token_ids=ids,
                    )
                )
        except Exception as exc:  # noqa: BLE001 - _fail maps every failure to its gRPC status
            raise self._fail(grpc_context, exc) from None
        self.frontend.count_ok("grpc")

    async def list_processors(
        self, request: Request[pb.ListProcessorsRequest], grpc_context: RayServegRPCContext
    ) -> pb.ListProcessorsResponse:
        try:
            self.frontend.authorize(_authorization(grpc_context))
            self._message(request, pb.ListProcessorsRequest)
            return processors_pb(self.frontend.processors.describe())
        except Exception as exc:  # noqa: BLE001 - _fail maps every failure to its gRPC status
            raise self._fail(grpc_context, exc) from None

    # -- grpc.health.v1.Health: open, like HTTP's /health ----------------------------------

    async def _status(self) -> health_pb2.HealthCheckResponse:
        serving = await self.frontend.workers_ready()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def check(
        self, request: Request[health_pb2.HealthCheckRequest], grpc_context: RayServegRPCContext
    ) -> health_pb2.HealthCheckResponse:
        """SERVING while some worker's engine loop is alive; NOT_FOUND for a service not served here."""
        try:
            msg = self._message(request, health_pb2.HealthCheckRequest)
            if msg.service not in HEALTH_SERVICES:
                raise reject(grpc_context, grpc.StatusCode.NOT_FOUND, f"service: unknown service {msg.service[:128]!r}")
            return await self._status()
        except Exception as exc:  # noqa: BLE001 - _fail maps every failure to its gRPC status
            raise self._fail(grpc_context, exc) from None

    async def list_health(
        self, request: Request[health_pb2.HealthListRequest], grpc_context: RayServegRPCContext
    ) -> health_pb2.HealthListResponse:
        """Every service `check` answers for, with the same status."""
        try:
            self._message(request, health_pb2.HealthListRequest)
            status = await self._status()
            return health_pb2.HealthListResponse(statuses={name: status for name in HEALTH_SERVICES})
        except Exception as exc:  # noqa: BLE001 - _fail maps every failure to its gRPC status
            raise self._fail(grpc_context, exc) from None

    async def watch(
        self, request: Request[health_pb2.HealthCheckRequest], grpc_context: RayServegRPCContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """UNIMPLEMENTED, which the health protocol tells clients not to retry: a watch would hold
        one of the ingress's ongoing-request slots for as long as any caller, keyless, kept it."""
        raise reject(
            grpc_context,
            grpc.StatusCode.UNIMPLEMENTED,
            "grpc.health.v1.Health/Watch is not implemented by this server; poll Check",
        )
        yield health_pb2.HealthCheckResponse()  # an async generator, as Serve's streaming path calls it

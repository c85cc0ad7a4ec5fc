"""The gRPC side of the front end: protobuf in and out around a `Frontend` (the ingress's
gRPC methods, which Serve's native gRPC proxy maps /Service/Method to, delegate here).

Status codes are set on ``grpc_context`` and the exception re-raised: Serve then ends the call
with that code (returning normally after set_code would end a stream with OK, truncated).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
import grpc
from grpc_health.v1 import health_pb2
from ray.serve.grpc_util import RayServegRPCContext

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster.errors import classify
from cluster.frontend import Frontend
from cluster.grpc_convert import delta_pb, processors_pb, prompt_from_pb, response_pb, sampling_params_from_pb
from cluster.grpc_servicers import MalformedRequest
from cluster.limits import PayloadTooLarge
from worker.outputs import OutputAccumulator
from worker.request import Scheduling
from worker.sampling_params import SamplingParams


def _authorization(ctx: RayServegRPCContext) -> str | None:
    for key, value in ctx.invocation_metadata() or ():
        if key.lower() == "authorization":
            return value
    return None


# Services the standard health check answers for ("" is the server as a whole).
HEALTH_SERVICES = frozenset({"", pb.DESCRIPTOR.services_by_name["LogitPool"].full_name})


def _engine_id(request_id: str) -> str:
    """A client's request_id is for tracing; two clients may send the same one concurrently."""
    return f"{request_id}-{uuid.uuid4().hex[:12]}"


class GrpcAdapter:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def _fail(self, ctx: RayServegRPCContext, exc: BaseException) -> BaseException:
        status = classify(exc)
        self.frontend.count_error(status, "grpc")
        ctx.set_code(status.grpc)
        ctx.set_details(status.message)
        return exc

    async def _prepare(
        self, request: pb.GenerateRequest, ctx: RayServegRPCContext
    ) -> tuple[str, list[int], SamplingParams]:
        self.frontend.authorize(_authorization(ctx))
        if isinstance(request, MalformedRequest):
            raise request.error()
        size, limit = request.ByteSize(), self.frontend.limits.max_body_bytes
        if size > limit:
            raise PayloadTooLarge(f"request: {size} bytes exceeds limits.max_body_bytes ({limit})")
        params = sampling_params_from_pb(request.params)
        (ids,) = await self.frontend.prepare(params, [prompt_from_pb(request)])
        rid = request.request_id if request.HasField("request_id") else uuid.uuid4().hex
        return rid, ids, params

    def _scheduling(self, request: pb.GenerateRequest, ctx: RayServegRPCContext, engine_id: str) -> Scheduling:
        """One group per call, under its API key's tenant (as HTTP)."""
        return self.frontend.scheduling(_authorization(ctx), engine_id, request.priority)

    async def generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext) -> pb.GenerateResponse:
        try:
            rid, ids, params = await self._prepare(request, grpc_context)
            engine_id = _engine_id(rid)
            out = await self.frontend.run(engine_id, ids, params, self._scheduling(request, grpc_context, engine_id))
        except Exception as exc:
            raise self._fail(grpc_context, exc) from None
        self.frontend.count_ok("grpc", [out])
        return response_pb(rid, out, self.frontend.decode_token)

    async def generate_stream(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        try:
            rid, ids, params = await self._prepare(request, grpc_context)
            engine_id = _engine_id(rid)
            sched = self._scheduling(request, grpc_context, engine_id)
        except Exception as exc:
            raise self._fail(grpc_context, exc) from None
        acc = OutputAccumulator()
        try:
            async for delta in self.frontend.stream_deltas(engine_id, ids, params, sched):
                total = acc.add(delta)
                if delta.finished:
                    total.prompt_token_ids = ids  # deltas arrive without the prompt
                yield delta_pb(rid, delta, self.frontend.decode_token, usage=total if delta.finished else None,
                               prompt_token_ids=ids)
        except Exception as exc:
            raise self._fail(grpc_context, exc) from None
        self.frontend.count_ok("grpc")

    async def list_processors(self, request: pb.ListProcessorsRequest, grpc_context: RayServegRPCContext) -> pb.ListProcessorsResponse:
        try:
            self.frontend.authorize(_authorization(grpc_context))
            if isinstance(request, MalformedRequest):
                raise request.error()
        except Exception as exc:
            raise self._fail(grpc_context, exc) from None
        return processors_pb(self.frontend.processors.describe())

    async def check(self, request: health_pb2.HealthCheckRequest, grpc_context: RayServegRPCContext) -> health_pb2.HealthCheckResponse:
        """SERVING while some worker's engine loop is alive; NOT_FOUND for a service not served here."""
        if isinstance(request, MalformedRequest):
            raise self._fail(grpc_context, request.error())
        if request.service not in HEALTH_SERVICES:
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"service: unknown service {request.service[:128]!r}")
            raise LookupError(request.service)
        serving = await self.frontend.workers_ready()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

"""The ingress deployment: OpenAI-compatible HTTP and native gRPC on one Serve deployment.

Composition only: one transport-free `Frontend` (validation, tokenization, dispatch, streaming,
readiness) held by two thin adapters, `HttpAdapter` (its FastAPI app is built per replica by
`__serve_build_asgi_app__`) and `GrpcAdapter` (the gRPC method names Serve's proxy calls are
declared here and delegate to it). A bad request never reaches a worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.grpc_util import RayServegRPCContext

from client.pb.logitpool.v1 import logitpool_pb2 as pb
from cluster import pool_stats
from cluster.config import LogitpoolConfig
from cluster.frontend import Frontend
from cluster.grpc_servicers import WireRequest
from cluster.metrics import LOCAL_REPLICA, shared
from cluster.openai.adapter import HttpAdapter
from cluster.openai.routes import build_api
from cluster.replica_bind import bind_replica_grpc_to_node_ip
from cluster.rpc.service import GrpcAdapter


def _replica(cfg: LogitpoolConfig) -> tuple[str, str]:
    """The Serve application this replica runs in (the workers publish their stats under it)
    and this replica's id; outside Serve's replicas (its local testing mode) the configured
    application and LOCAL_REPLICA."""
    try:
        ctx = serve.get_replica_context()
    except RayServeException:
        return cfg.app_name, LOCAL_REPLICA
    return ctx.app_name, ctx.replica_id.unique_id


class LogitpoolIngress:
    def __init__(self, worker: Any, config: dict[str, Any]) -> None:
        bind_replica_grpc_to_node_ip()
        cfg = LogitpoolConfig.model_validate(config)
        app_name, replica_id = _replica(cfg)
        self.app_name, self.replica_id = app_name, replica_id
        self.frontend = Frontend(
            cfg,
            worker,
            pool=lambda: pool_stats.collect(app_name),
            peers=lambda: pool_stats.collect_published(app_name, shared.KIND, shared.IngressSnapshot.from_json),
            replica_id=replica_id,
        )
        self.http = HttpAdapter(self.frontend)
        self.grpc = GrpcAdapter(self.frontend)
        self._publisher: asyncio.Task[None] | None = None

    async def check_health(self) -> None:
        """Serve calls this every few seconds: it keeps this replica's metrics publisher running
        (cluster.metrics.shared), as the worker replicas' check_health keeps theirs."""
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.create_task(pool_stats.publish_forever(self._publish))

    async def _publish(self) -> None:
        snapshot = self.frontend.metrics.snapshot
        await pool_stats.publish_logged(self.app_name, self.replica_id, snapshot, shared.KIND, "ingress metrics")

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.http)

    # -- gRPC: logitpool.v1.LogitPool and grpc.health.v1.Health ----------------------------
    # Requests arrive unparsed (a WireRequest, cluster.grpc_servicers); the adapter parses them.

    async def Generate(self, request: WireRequest, grpc_context: RayServegRPCContext) -> pb.GenerateResponse:
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(
        self, request: WireRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async for msg in self.grpc.generate_stream(request, grpc_context):
            yield msg

    async def ListProcessors(
        self, request: WireRequest, grpc_context: RayServegRPCContext
    ) -> pb.ListProcessorsResponse:
        return await self.grpc.list_processors(request, grpc_context)

    async def Check(self, request: WireRequest, grpc_context: RayServegRPCContext) -> health_pb2.HealthCheckResponse:
        return await self.grpc.check(request, grpc_context)

    async def List(self, request: WireRequest, grpc_context: RayServegRPCContext) -> health_pb2.HealthListResponse:
        return await self.grpc.list_health(request, grpc_context)

    async def Watch(
        self, request: WireRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        async for msg in self.grpc.watch(request, grpc_context):
            yield msg


IngressDeployment = serve.deployment(name="LogitpoolIngress")(serve.ingress()(LogitpoolIngress))

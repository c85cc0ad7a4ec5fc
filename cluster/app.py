"""The one composition root: a LogitpoolConfig in, a Serve application out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray import serve

from cluster.config import LogitpoolConfig
from cluster.deploy.serve_config import INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT, deployment_options, routing_policy
from cluster.ingress import IngressDeployment
from cluster.routing.config import ROUTER_CLASS
from cluster.worker_deployment import EngineFactory, WorkerDeployment, served_engine
from worker.logits_processor.registry import fqcn_of, resolve_processor_class


def processor_fqcns(processors: Sequence[str | type]) -> tuple[str, ...]:
    """Class objects become FQCN strings (they travel to workers by name, never as code).

    A class that cannot be imported back from its FQCN is rejected here, at build time.
    """
    out = []
    for p in processors:
        if isinstance(p, str):
            out.append(p)
            continue
        fqcn = fqcn_of(p)
        if resolve_processor_class(fqcn) is not p:
            raise ValueError(f"logits processor {p!r}: {fqcn} does not import back to the same class")
        out.append(fqcn)
    return tuple(out)


def resolve_model(cfg: LogitpoolConfig) -> LogitpoolConfig:
    """The embedded default: build the tiny model on first use and point the config at it."""
    if cfg.engine.model is not None:
        return cfg
    from worker.model.loader import embedded_model_path

    path = embedded_model_path()
    return cfg.with_overrides(**{"engine.model": str(path)})


def build_app(
    cfg: LogitpoolConfig,
    *,
    processors: Sequence[type] = (),
    engine_factory: EngineFactory = served_engine,
    router_class: str = ROUTER_CLASS,
) -> serve.Application:
    """The application; `engine_factory` builds each worker replica's engine from its EngineConfig
    (by reference: a class or module-level function, so it pickles); `router_class` routes to the
    worker replicas under the cache-aware policy (a benchmark's baseline may replace it)."""
    if processors:
        cfg = cfg.with_overrides(
            **{"engine.logits_processors": cfg.engine.logits_processors + processor_fqcns(processors)}
        )
    cfg = resolve_model(cfg)
    opts = deployment_options(cfg, router_class)
    cache_aware = routing_policy(cfg) == "cache_aware"
    worker = WorkerDeployment.options(**opts[WORKER_DEPLOYMENT]).bind(
        engine=cfg.engine.as_kwargs(),
        stream_interval_s=cfg.workers.stream_interval_s,
        engine_factory=engine_factory,
        published_blocks=cfg.routing.max_published_blocks if cache_aware else 0,
    )
    return IngressDeployment.options(**opts[INGRESS_DEPLOYMENT]).bind(worker, cfg.model_dump())


def app_builder(args: dict[str, Any]) -> serve.Application:
    """`import_path: cluster.app:app_builder` in a Serve config; `args` is a LogitpoolConfig."""
    return build_app(LogitpoolConfig.model_validate(args or {}))

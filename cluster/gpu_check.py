"""A worker replica that Ray gave GPUs must find CUDA, unless its config allows the CPU.

Without this check the engine's `device: None` ("cuda if available") would quietly run a GPU
deployment on the CPU of a node whose torch build or driver cannot see the GPU."""

from __future__ import annotations

from collections.abc import Sequence


def gpu_problem(
    gpu_ids: Sequence[object], device: str | None, cuda_available: bool, allow_cpu: bool, visible: str | None
) -> str | None:
    """Why this replica must not start, or None. `visible` is its CUDA_VISIBLE_DEVICES."""
    if cuda_available:
        return None
    wants_cuda = device is not None and device.startswith("cuda")
    if not wants_cuda and (not gpu_ids or allow_cpu or device in ("cpu", "mps")):
        return None
    given = (
        f"Ray assigned GPU(s) {list(gpu_ids)} (CUDA_VISIBLE_DEVICES={visible!r})" if gpu_ids else f"device {device!r}"
    )
    return (
        f"worker replica: {given} but torch finds no CUDA device (a CPU-only torch build, or no driver); "
        "fix the node, or set engine.device: auto to allow the CPU"
    )


def check_gpu(allow_cpu: bool, device: str | None) -> None:
    """Raise RuntimeError in a worker replica whose GPUs are not usable (see gpu_problem)."""
    import os

    import ray
    import torch

    # Outside a Ray worker (Serve's local testing mode) nothing assigned GPUs; asking would start Ray.
    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    problem = gpu_problem(gpu_ids, device, torch.cuda.is_available(), allow_cpu, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if problem is not None:
        raise RuntimeError(problem)

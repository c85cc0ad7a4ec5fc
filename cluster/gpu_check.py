"""Which device a worker replica's engine runs on, decided from the GPUs Ray gave it.

A replica that Ray gave GPUs must find CUDA, unless its config allows the CPU: without this
check the engine's `device: None` ("cuda if available") would quietly run a GPU deployment on
the CPU of a node whose torch build or driver cannot see the GPU. A replica Ray gave no GPU
(`workers.num_gpus: 0`, the local default) runs on CPU: Ray 2.60 leaves CUDA_VISIBLE_DEVICES
as it is for such actors, so "cuda if available" would put every replica of `logitpool serve` on
a GPU host onto cuda:0, unaccounted. The decision is logged in one line."""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)


def gpu_problem(
    gpu_ids: Sequence[object], device: str | None, cuda_available: bool, allow_cpu: bool, visible: str | None
) -> str | None:
    """Why this replica must not start, or None. `visible` is its CUDA_VISIBLE_DEVICES."""
    wants_cuda = device is not None and device.startswith("cuda")
    if cuda_available:
        if wants_cuda and not gpu_ids:
            return (
                f"worker replica: engine.device {device!r} but Ray gave this replica no GPU "
                "(workers.num_gpus: 0); set workers.num_gpus, or engine.device: auto to run on CPU"
            )
        return None
    if not wants_cuda and (not gpu_ids or allow_cpu or device in ("cpu", "mps")):
        return None
    given = (
        f"Ray assigned GPU(s) {list(gpu_ids)} (CUDA_VISIBLE_DEVICES={visible!r})" if gpu_ids else f"device {device!r}"
    )
    return (
        f"worker replica: {given} but torch finds no CUDA device (a CPU-only torch build, or no driver); "
        "fix the node, or set engine.device: auto to allow the CPU"
    )


def replica_device(
    gpu_ids: Sequence[object], device: str | None, cuda_available: bool, visible: str | None
) -> tuple[str | None, str]:
    """The engine's device for a replica that passed `gpu_problem`, and the line saying why."""
    if device is not None and device != "cuda":
        return device, f"worker replica: engine.device {device!r} as configured (Ray GPU ids {list(gpu_ids)})"
    if not gpu_ids:
        ignored = f"; CUDA_VISIBLE_DEVICES={visible!r} is left unused" if cuda_available else ""
        return "cpu", f"worker replica: Ray gave it no GPU (workers.num_gpus: 0): running on cpu{ignored}"
    if cuda_available:
        return "cuda", f"worker replica: Ray gave it GPU(s) {list(gpu_ids)} (CUDA_VISIBLE_DEVICES={visible!r}): cuda:0"
    return "cpu", f"worker replica: Ray gave it GPU(s) {list(gpu_ids)} but torch finds no CUDA device: cpu (allowed)"


def check_gpu(allow_cpu: bool, device: str | None) -> str | None:
    """The engine's device in this worker replica (logged); RuntimeError when its GPUs are not
    usable (see gpu_problem)."""
    import os

    import ray
    import torch

    # Outside a Ray worker (Serve's local testing mode) nothing assigned GPUs; asking would start Ray.
    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    cuda = torch.cuda.is_available()
    problem = gpu_problem(gpu_ids, device, cuda, allow_cpu, visible)
    if problem is not None:
        raise RuntimeError(problem)
    chosen, line = replica_device(gpu_ids, device, cuda, visible)
    logger.info("%s", line)
    return chosen

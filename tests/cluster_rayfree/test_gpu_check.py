"""A worker replica given GPUs by Ray but finding no CUDA device refuses to start (a GPU
deployment must not run on the CPU unnoticed) unless its config says `device: auto`."""

from __future__ import annotations

import pytest

from cluster.config import LogitpoolConfig
from cluster.gpu_check import gpu_problem
from cluster.worker_deployment import replica_engine_config


@pytest.mark.parametrize(
    ("gpu_ids", "device", "cuda", "allow_cpu", "fails"),
    [
        ([0], None, False, False, True),  # GPU assigned, CPU-only torch: refuse
        ([0], None, False, True, False),  # ... unless device: auto
        ([0], "cpu", False, False, False),  # explicitly CPU
        ([0], None, True, False, False),  # CUDA present
        ([], None, False, False, False),  # a CPU deployment
        ([], "cuda", False, True, True),  # explicitly CUDA, none there: refuse even with auto
        ([1], "cuda:0", True, False, False),
    ],
)
def test_gpu_problem(gpu_ids, device, cuda, allow_cpu, fails):
    problem = gpu_problem(gpu_ids, device, cuda, allow_cpu, "1" if gpu_ids else None)
    assert (problem is not None) == fails
    if fails:
        assert "no CUDA device" in problem and "engine.device: auto" in problem


def test_device_auto_reaches_the_engine_as_its_default():
    cfg = LogitpoolConfig.model_validate({"engine": {"model": "/m", "device": "auto"}})
    engine, allow_cpu = replica_engine_config(cfg.engine)
    assert cfg.engine.device == "auto" and engine.device is None and allow_cpu
    assert replica_engine_config(LogitpoolConfig.model_validate({"engine": {"device": "cpu"}}).engine)[1] is False
    with pytest.raises(ValueError, match="device must be auto, cpu"):
        LogitpoolConfig.model_validate({"engine": {"device": "gpu"}})

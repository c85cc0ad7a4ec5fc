"""A worker replica given GPUs by Ray but finding no CUDA device refuses to start (a GPU
deployment must not run on the CPU unnoticed) unless its config says `device: auto`; one given
no GPU runs on CPU even where CUDA is visible (issue 20, bug 2); a config that would leave GPUs
idle or name a device Ray never shows a replica is refused (bug 7)."""

from __future__ import annotations

import logging

import pytest
import torch

from cluster.config import LogitpoolConfig
from cluster.gpu_check import check_gpu, gpu_problem, replica_device
from cluster.worker_deployment import LogitpoolWorker, replica_engine_config
from worker.config import EngineConfig


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


@pytest.mark.parametrize(
    ("gpu_ids", "device", "cuda", "chosen", "says"),
    [
        ([], None, True, "cpu", "no GPU (workers.num_gpus: 0): running on cpu; CUDA_VISIBLE_DEVICES='0,1'"),
        ([], None, False, "cpu", "no GPU (workers.num_gpus: 0): running on cpu"),
        ([], "cpu", True, "cpu", "as configured"),
        ([3], None, True, "cuda", "GPU(s) [3] (CUDA_VISIBLE_DEVICES='0,1'): cuda:0"),
        ([3], "cuda", True, "cuda", "cuda:0"),
        ([3], None, False, "cpu", "torch finds no CUDA device: cpu (allowed)"),
    ],
)
def test_replica_device(gpu_ids, device, cuda, chosen, says):
    got, line = replica_device(gpu_ids, device, cuda, "0,1")
    assert got == chosen and says in line and "\n" not in line


def test_cuda_without_a_gpu_from_ray_is_refused():
    problem = gpu_problem([], "cuda", True, True, "0")
    assert problem is not None and "workers.num_gpus" in problem


def test_a_replica_given_no_gpu_runs_on_cpu_where_cuda_is_visible(monkeypatch, caplog):
    """The local default (workers.num_gpus: 0) on a GPU host: every replica used to take cuda:0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built: list[EngineConfig] = []

    def factory(config: EngineConfig):
        built.append(config)
        return object()

    with caplog.at_level(logging.INFO, logger="cluster.gpu_check"):
        assert check_gpu(allow_cpu=False, device=None) == "cpu"
        LogitpoolWorker(EngineConfig(model="/m").as_kwargs(), engine_factory=factory)  # type: ignore[arg-type]  # a test double for the engine factory
    assert [c.device for c in built] == ["cpu"]
    lines = [r.getMessage() for r in caplog.records if r.name == "cluster.gpu_check"]
    assert len(lines) == 2 and all("no GPU (workers.num_gpus: 0): running on cpu" in m for m in lines)


@pytest.mark.parametrize("gpus", [1.5, 2, 8])
def test_more_than_one_gpu_per_replica_is_refused(gpus):
    with pytest.raises(ValueError, match=r"workers.num_gpus: .*engine.tensor_parallel_size"):
        LogitpoolConfig.model_validate({"workers": {"num_gpus": gpus}})
    assert LogitpoolConfig.model_validate({"workers": {"num_gpus": 0.5}}).workers.num_gpus == 0.5


def test_a_device_ray_never_shows_a_replica_is_refused():
    with pytest.raises(ValueError, match=r"device: 'cuda:1' cannot work under Ray"):
        LogitpoolConfig.model_validate({"engine": {"device": "cuda:1"}, "workers": {"num_gpus": 1}})
    with pytest.raises(ValueError, match=r"engine.device: 'cuda' but workers.num_gpus is 0"):
        LogitpoolConfig.model_validate({"engine": {"device": "cuda"}})
    ok = LogitpoolConfig.model_validate({"engine": {"device": "cuda:0"}, "workers": {"num_gpus": 1}})
    assert ok.engine.device == "cuda:0"

"""An operator's commands against a live deployment on the session's Ray cluster, which declares
two GPUs (no real ones): a replica's start-up failure is reported with its cause (here: a GPU
without CUDA), replicas land on distinct GPUs, one that cannot be placed is reported as pending
instead of waited on, and `logitpool status` / `logitpool scale` work on the result."""

from __future__ import annotations

import time

import pytest

from cluster.cli.errors import CliError
from cluster.cli.launch import healthy
from cluster.cli.main import main
from cluster.config import LogitpoolConfig
from tests.cluster.serving_helpers import deploy

pytestmark = pytest.mark.ray

APP = "operator"


def config(model: str, ports: tuple[int, int], replicas: int, **engine) -> LogitpoolConfig:
    # The routing policy is pinned: left to its default it follows the replica count, and
    # `scale 1` would then restart every worker replica under the other router (tens of seconds
    # here), which this module does not test.
    return LogitpoolConfig.model_validate(
        {
            "engine": {"model": model, "max_num_seqs": 4, "max_model_len": 64, **engine},
            "workers": {"num_replicas": replicas, "num_cpus": 0.5, "num_gpus": 1},
            "server": {"http_port": ports[0], "grpc_port": ports[1]},
            "routing": {"policy": "cache_aware"},
            "app_name": APP,
        }
    )


@pytest.mark.slow
def test_gpu_without_cuda_fails_with_its_cause(serve_ports, tiny_model_dir, monkeypatch):
    import torch
    from ray import serve

    import cluster.app
    from cluster.deploy.serve_config import WORKER_DEPLOYMENT

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: a GPU replica starts")

    options = cluster.app.deployment_options

    def one_try(*args, **kwargs):
        """Serve fails the deployment at the first failed start, not the third (its default for one
        replica; each try is a fresh replica process, ~10 s here): the cause reported is the same."""
        opts = options(*args, **kwargs)
        opts[WORKER_DEPLOYMENT]["max_constructor_retry_count"] = 1
        return opts

    monkeypatch.setattr(cluster.app, "deployment_options", one_try)
    try:
        with pytest.raises(CliError, match=r"deployment failed: LogitpoolWorker: .*no CUDA device.*device: auto"):
            deploy(config(str(tiny_model_dir), serve_ports, 1), timeout_s=120)
    finally:
        serve.delete(APP)


@pytest.mark.slow
def test_placement_pending_status_and_scale(serve_ports, tiny_model_dir, tmp_path, capsys):
    import ray
    from ray import serve

    from cluster.cli import session

    # Three replicas of one GPU each on two GPUs: two run (one per GPU), the third is pending.
    cfg = config(str(tiny_model_dir), serve_ports, 3, device="auto")
    cfg = deploy(cfg, timeout_s=180, serving=lambda: healthy("127.0.0.1", serve_ports[0]))
    assert "not every replica has started" in capsys.readouterr().err
    path = tmp_path / "session.json"
    session.write(path, ray.get_runtime_context().gcs_address, cfg.model_dump(mode="json", exclude={"api_keys"}))
    try:
        handle = serve.get_deployment_handle("LogitpoolWorker", app_name=APP)
        deadline = time.monotonic() + 90  # the second replica may still be starting
        while True:
            infos = {
                i["replica_id"]: i["cuda_visible_devices"]
                for i in (handle.info.remote().result(timeout_s=30) for _ in range(12))
            }
            assert main(["status", "--session", str(path)]) == 0
            out = capsys.readouterr().out
            if (len(infos) == 2 and "worker replicas reporting: 2" in out) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert sorted(infos.values()) == ["0", "1"], infos
        assert (
            f"application {APP}: DEPLOYING" in out
            and "to be scheduled" in out
            and "worker replicas reporting: 2" in out
        )
        assert main(["scale", "1", "--session", str(path)]) == 0
        assert main(["status", "--session", str(path)]) == 0
        assert "LogitpoolWorker: HEALTHY  replicas: RUNNING=1" in capsys.readouterr().out
        assert session.read(path)["config"]["workers"]["num_replicas"] == 1
    finally:
        serve.delete(APP)
        session.remove(path)
    assert not path.exists()

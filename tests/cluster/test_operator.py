"""An operator's commands against a live deployment on the session's Ray cluster: a replica's
start-up failure is reported with its cause, `logitpool status` and `logitpool scale`."""

from __future__ import annotations


import pytest

from cluster.cli import deploy, main
from cluster.cli_errors import CliError
from cluster.config import LogitpoolConfig

pytestmark = pytest.mark.ray

APP = "operator"


def config(model: str, ports: tuple[int, int], **extra) -> LogitpoolConfig:
    return LogitpoolConfig.model_validate({
        "engine": {"model": model, "max_num_seqs": 4, "max_model_len": 64},
        "workers": {"num_replicas": 1, "num_cpus": 0.5},
        "server": {"http_port": ports[0], "grpc_port": ports[1]},
        "app_name": APP, **extra,
    })


@pytest.mark.slow
def test_start_up_failure_names_its_cause(serve_ports, tmp_path):
    from ray import serve

    (tmp_path / "config.json").write_text("{}")  # a directory that is not a model
    try:
        with pytest.raises(CliError, match=r"deployment failed: .*(Unrecognized model|tokenizer)"):
            deploy(config(str(tmp_path), serve_ports), timeout_s=120)
    finally:
        serve.delete(APP)


@pytest.mark.slow
def test_status_and_scale(serve_ports, tiny_model_dir, tmp_path, capsys):
    import ray
    from ray import serve

    from cluster import session

    cfg = deploy(config(str(tiny_model_dir), serve_ports))
    path = tmp_path / "session.json"
    session.write(path, ray.get_runtime_context().gcs_address, cfg.model_dump(mode="json", exclude={"api_keys"}))
    try:
        assert main(["status", "--session", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"application {APP}: RUNNING" in out and "LogitpoolWorker: HEALTHY  replicas: RUNNING=1" in out
        assert main(["scale", "2", "--session", str(path)]) == 0
        assert main(["status", "--session", str(path)]) == 0
        assert "LogitpoolWorker: HEALTHY  replicas: RUNNING=2" in capsys.readouterr().out
        assert session.read(path)["config"]["workers"]["num_replicas"] == 2
    finally:
        serve.delete(APP)
        session.remove(path)
    assert not path.exists()

"""The `ray up` configs: valid for Ray's own launcher schema, and saying what the docs say."""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.config import LogitpoolConfig

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "cluster" / "ray-up.gpu.yaml"
GPU_TP = REPO / "cluster" / "ray-up.gpu-tp.yaml"
LOCAL = REPO / "cluster" / "ray-up.local.yaml"
HEREDOC = re.compile(r"cat > ~/logitpool\.yaml <<'EOF'\n(?P<body>.*?)\nEOF\n?$", re.S)


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def ray_pin() -> str:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (spec,) = [d for d in pyproject["project"]["optional-dependencies"]["serve"] if d.startswith("ray[")]
    return spec.split("==")[1]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    text = (importlib.resources.files("ray.autoscaler") / "ray-schema.json").read_text(encoding="utf-8")
    schema = json.loads(text)
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("path", [GPU, GPU_TP, LOCAL], ids=["gpu", "gpu-tp", "local"])
def test_valid_under_rays_schema_and_prepare_step(path: Path, validator: jsonschema.Draft7Validator) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = load(path)
    validator.validate(cfg)
    validate_config(prepare_config(copy.deepcopy(cfg)))  # what `ray up` runs before launching


@pytest.mark.parametrize("path", [GPU, GPU_TP, LOCAL], ids=["gpu", "gpu-tp", "local"])
def test_the_schema_check_has_teeth(path: Path, validator: jsonschema.Draft7Validator) -> None:
    for bad in ({"min_workers": 1}, {"setup_command": []}):
        with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
            validator.validate(load(path) | bad)


@pytest.mark.parametrize("path", [GPU, GPU_TP, LOCAL], ids=["gpu", "gpu-tp", "local"])
def test_installs_torch_then_logitpool_with_serve_extras(path: Path) -> None:
    commands = load(path)["setup_commands"]
    torch = [i for i, c in enumerate(commands) if re.search(r"pip install .*torch==2\.13\.0", c)]
    package = [i for i, c in enumerate(commands) if re.search(r"pip install .*logitpool\[serve\]", c)]
    assert torch and package and torch[0] < package[0]


@pytest.mark.parametrize("path", [GPU, GPU_TP, LOCAL], ids=["gpu", "gpu-tp", "local"])
def test_start_commands_set_auth_mode_and_disable_usage_stats(path: Path) -> None:
    cfg = load(path)
    for key, role in [("head_start_ray_commands", "--head"), ("worker_start_ray_commands", "--address=")]:
        starts = [c for c in cfg[key] if "ray start" in c]
        assert len(starts) == 1, key
        assert role in starts[0] and "--disable-usage-stats" in starts[0]
        assert re.search(r"\bRAY_AUTH_MODE=(disabled|token)\b", starts[0])
        assert cfg[key][0] == "ray stop"
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in cfg["head_start_ray_commands"][-1]


@pytest.mark.parametrize("path", [GPU, GPU_TP, LOCAL], ids=["gpu", "gpu-tp", "local"])
def test_the_written_logitpool_config_is_valid(path: Path) -> None:
    bodies = [m["body"] for c in load(path)["setup_commands"] if (m := HEREDOC.search(c))]
    assert len(bodies) == 1
    cfg = LogitpoolConfig.model_validate(yaml.safe_load(bodies[0]))
    assert cfg.engine.model and cfg.server.host == "0.0.0.0"


@pytest.mark.parametrize("path", [GPU, GPU_TP], ids=["gpu", "gpu-tp"])
def test_gpu_cluster_shape(path: Path) -> None:
    cfg = load(path)
    nodes = cfg["available_node_types"]
    head = nodes[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] > 0
    (gpu_type,) = [n for name, n in nodes.items() if name != cfg["head_node_type"]]
    assert gpu_type["resources"]["GPU"] >= 1
    assert 0 <= gpu_type["min_workers"] <= gpu_type["max_workers"] <= cfg["max_workers"]
    assert cfg["provider"]["type"] == "aws" and cfg["provider"]["region"]
    assert cfg["docker"]["image"] == f"rayproject/ray:{ray_pin()}-py311-gpu"
    # The deployment it writes fits the nodes: a replica's ranks (one GPU each) on one node, as
    # many replicas as the nodes hold.
    body = next(m["body"] for c in cfg["setup_commands"] if (m := HEREDOC.search(c)))
    lp = LogitpoolConfig.model_validate(yaml.safe_load(body))
    ranks, gpus = lp.engine.tensor_parallel_size, gpu_type["resources"]["GPU"]
    assert 0 < lp.workers.num_gpus * ranks <= gpus and lp.worker_cpus * ranks <= gpu_type["resources"]["CPU"]
    per_node = int(gpus // (lp.workers.num_gpus * ranks))
    auto = lp.workers.autoscaling
    assert auto is not None and auto.max_replicas <= gpu_type["max_workers"] * per_node
    assert (ranks > 1) == (path == GPU_TP)


@pytest.mark.parametrize("path", [GPU, GPU_TP], ids=["gpu", "gpu-tp"])
def test_gpu_operator_settings_come_first(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    marker = text.index("Usually left as is")
    for setting in [
        "cluster_name:",
        "region:",
        "InstanceType:",
        "min_workers:",
        "max_workers:",
        "logitpool version",
        "model:",
    ]:
        assert text.index(setting) < marker, setting


def test_local_provider_shape() -> None:
    cfg = load(LOCAL)
    assert cfg["provider"]["type"] == "local"
    assert isinstance(cfg["provider"]["head_ip"], str) and isinstance(cfg["provider"]["worker_ips"], list)
    assert {"ssh_user", "ssh_private_key"} <= set(cfg["auth"])
    assert "min_workers" not in cfg  # the raw schema rejects it (Ray's prepare step strips it)

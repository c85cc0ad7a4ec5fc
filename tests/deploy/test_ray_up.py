"""A real `ray up` on loopback: sshd on 127.0.0.1 as the "remote" head, the committed
`cluster/ray-up.local.yaml` (pointed at it), `serve deploy` of the generated Serve config with
the tiny model, one HTTP and one gRPC request, `ray down`, and no Ray process left behind.

The head runs in its own PID/mount namespace (see tests/deploy/sshd.py), so the `ray stop` that
`ray up`/`ray down` run there cannot touch this session's Ray cluster; every port is a free one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import LogitpoolConfig
from cluster.deploy.serve_config import render_yaml
from tests.deploy import sshd

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "cluster" / "ray-up.local.yaml"
BIN = Path(sys.executable).parent
UP_TIMEOUT_S, DEPLOY_TIMEOUT_S, DOWN_TIMEOUT_S = 300, 300, 180

PORT_NAMES = (
    "gcs",
    "dashboard",
    "client",
    "agent_listen",
    "agent_grpc",
    "runtime_env_agent",
    "metrics",
    "node_manager",
    "object_manager",
    "http",
    "grpc",
)


def free_ports(names: tuple[str, ...]) -> dict[str, int]:
    """Distinct free ports, all held open while picking so none is handed out twice."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in names]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return {name: s.getsockname()[1] for name, s in zip(names, socks, strict=True)}


def launcher_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    return env | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def run(cmd: list[str], log: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    log.write_text(f"$ {' '.join(cmd)}\n[rc={done.returncode}]\n{done.stdout}\n--- stderr ---\n{done.stderr}")
    return done


def tail(done: subprocess.CompletedProcess[str], n: int = 3000) -> str:
    return (done.stdout + "\n" + done.stderr)[-n:]


def derived_config(node: sshd.LoopbackSSHD, ports: dict[str, int], name: str) -> dict[str, Any]:
    """The committed local-provider config, pointed at the loopback sshd and at free ports."""
    cfg = yaml.safe_load(LOCAL.read_text(encoding="utf-8"))
    cfg["cluster_name"] = name
    cfg["provider"] = {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    cfg["auth"] = {
        "ssh_user": node.user,
        "ssh_private_key": str(node.key),
        "ssh_proxy_command": node.proxy_command,
    }  # Ray has no SSH port option
    # The venv already holds torch and logitpool: keep every setup step but the installs, and
    # check instead that the synced checkout imports on the node.
    installs = [c for c in cfg["setup_commands"] if c.lstrip().startswith("pip install")]
    assert len(installs) == 2, installs
    cfg["setup_commands"] = [c for c in cfg["setup_commands"] if c not in installs] + [
        "python -c 'import cluster.deploy.serve_config, client.pb.logitpool.v1.logitpool_pb2_grpc'"
    ]
    start = cfg["head_start_ray_commands"][-1]
    for old, new in [
        ("--port=6379", f"--port={ports['gcs']}"),
        ("--dashboard-port=8265", f"--dashboard-port={ports['dashboard']}"),
        ("--dashboard-host=0.0.0.0", "--dashboard-host=127.0.0.1"),
    ]:
        assert old in start, old
        start = start.replace(old, new)
    start += (
        " --node-ip-address=127.0.0.1"
        f" --ray-client-server-port={ports['client']}"
        f" --dashboard-agent-listen-port={ports['agent_listen']}"
        f" --dashboard-agent-grpc-port={ports['agent_grpc']}"
        f" --runtime-env-agent-port={ports['runtime_env_agent']}"
        f" --metrics-export-port={ports['metrics']}"
        f" --node-manager-port={ports['node_manager']}"
        f" --object-manager-port={ports['object_manager']}"
    )
    cfg["head_start_ray_commands"] = [*cfg["head_start_ray_commands"][:-1], start]
    return cfg


def wait_for_app(dashboard: int, app: str, timeout: float) -> dict[str, Any]:
    """Poll the dashboard's Serve API until `app` is RUNNING; fail early on DEPLOY_FAILED."""
    url = f"http://127.0.0.1:{dashboard}/api/serve/applications/"
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(url, timeout=10) as resp:
            status = json.load(resp).get("applications", {}).get(app, {})
        if status.get("status") == "RUNNING":
            return status
        if status.get("status") in {"DEPLOY_FAILED", "UNHEALTHY"}:
            pytest.fail(f"application {app} is {status['status']}: {status.get('message', '')[-3000:]}")
        time.sleep(2)
    pytest.fail(f"application {app} not RUNNING after {timeout}s; last status {json.dumps(status)[-3000:]}")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sshd.LoopbackSSHD]:
    reason = sshd.ensure_packages() or sshd.namespaces_available()
    if reason:
        pytest.skip(reason)
    cache = os.environ.get("LOGITPOOL_CACHE") or str(Path.home() / ".cache" / "logitpool")
    started = sshd.start(
        tmp_path_factory.mktemp("ray_up"),
        path_dirs=[str(BIN)],
        env={
            "PYTHONPATH": "$HOME/logitpool",
            "LOGITPOOL_CACHE": cache,
            "HF_HUB_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
        },
    )
    yield started
    started.stop()  # kills whatever is left in the node's namespace


def test_ray_up_deploy_request_ray_down(node: sshd.LoopbackSSHD, tmp_path: Path) -> None:
    from ray.autoscaler._private.local.config import get_lock_path, get_state_path
    from ray.serve.schema import ServeDeploySchema

    from client import Client

    ports = free_ports(PORT_NAMES)
    config = tmp_path / "cluster.yaml"
    name = f"logitpool-test-{os.getpid()}-{ports['gcs']}"
    derived = derived_config(node, ports, name)
    config.write_text(yaml.safe_dump(derived, sort_keys=False), encoding="utf-8")
    timings: dict[str, float] = {}
    try:  # whatever fails from here on, the cluster is still torn down
        t0 = time.monotonic()
        done = run(
            [str(BIN / "ray"), "up", "-y", "--no-config-cache", "--log-style=record", str(config)],
            tmp_path / "ray_up.log",
            UP_TIMEOUT_S,
        )
        assert done.returncode == 0, tail(done)
        timings["ray up"] = time.monotonic() - t0
        head = node.ray_processes()
        assert any("raylet" in cmd for _, cmd in head) and any("gcs_server" in cmd for _, cmd in head), head

        # Deploy the generated Serve config (tiny model, free ports) against the cluster's dashboard.
        cfg = LogitpoolConfig.model_validate(
            {"server": {"host": "127.0.0.1", "http_port": ports["http"], "grpc_port": ports["grpc"]}}
        )
        serve_file = tmp_path / "serve.yaml"
        serve_file.write_text(render_yaml(cfg), encoding="utf-8")
        ServeDeploySchema.model_validate(yaml.safe_load(serve_file.read_text(encoding="utf-8")))
        t0 = time.monotonic()
        done = run(
            [str(BIN / "serve"), "deploy", str(serve_file), "-a", f"http://127.0.0.1:{ports['dashboard']}"],
            tmp_path / "serve_deploy.log",
            120,
        )
        assert done.returncode == 0, tail(done)
        wait_for_app(ports["dashboard"], cfg.app_name, DEPLOY_TIMEOUT_S)
        timings["deploy to RUNNING"] = time.monotonic() - t0

        body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{ports['http']}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            assert resp.status == 200
            completion = json.load(resp)
        http_text = completion["choices"][0]["text"]
        assert isinstance(http_text, str) and 1 <= completion["usage"]["completion_tokens"] <= 4

        with Client(f"127.0.0.1:{ports['grpc']}", timeout=120) as client:
            out = client.generate("Hello", max_tokens=4, temperature=0.0)
        assert 1 <= len(out.token_ids) <= 4
        assert out.text == http_text  # greedy: both front ends reach the same worker and model
    finally:
        t0 = time.monotonic()
        down = run(
            [str(BIN / "ray"), "down", "-y", "--log-style=record", str(config)],
            tmp_path / "ray_down.log",
            DOWN_TIMEOUT_S,
        )
        timings["ray down"] = time.monotonic() - t0
        print(f"timings (s): { {k: round(v, 1) for k, v in timings.items()} }")
        for launcher_file in (get_lock_path(name), get_state_path(name)):  # the local provider's records
            Path(launcher_file).unlink(missing_ok=True)
    assert down.returncode == 0, tail(down)
    # `ray stop` waits for what it kills; allow stragglers of the killed raylet a moment to exit.
    deadline = time.monotonic() + 30
    while (left := [p for p in node.processes() if not p[1].startswith(("sshd", "/usr/sbin/sshd"))]) and (
        time.monotonic() < deadline
    ):
        time.sleep(1)
    assert left == [], f"processes left on the node after ray down: {left}"

"""Start (or join) Ray, start Serve's proxies and deploy logitpool; wait until it serves.

Used by the CLI (`logitpool serve` / `scale`), the benchmarks and the tests: no command-line
parsing here, so nothing that launches a server imports the CLI.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from cluster.cli.errors import CliError

READY_TIMEOUT_S = 600.0
LOCAL_NUM_CPUS = 8
# Ray's setting for the nice value of the worker processes it starts (its default: 15).
WORKER_NICENESS_ENV = "RAY_worker_niceness"


def local_cluster_env(cfg: Any, token_dir: Path | None = None) -> dict[str, str]:
    """Environment for a Ray cluster this CLI starts itself (set before Ray is imported).

    - Every Ray listener (GCS, raylet, object manager, agents, workers) binds the node address,
      which is loopback unless `server.host` asks for all interfaces: Ray then treats the node
      as a single-machine cluster (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes its node address
      the loopback one; that variable only decides this).
    - Token authentication on (RAY_AUTH_MODE=token) with a fresh random token per start, in a
      file only this user can read; RAY_AUTH_MODE=disabled set by the caller is respected (the
      test suite does, for its own clusters) and warned about.
    - Serve's HTTP proxy gets the request read timeout (cluster.slow_clients), and its gRPC proxy
      a message size bound, limits.max_grpc_message_bytes (Serve's default is 2 GiB, received
      whole before any check of ours).
    - The serving processes (proxy, ingress, workers) run at normal priority: Ray starts worker
      processes at nice 15, so on a box shared with other programs the server itself was the
      first to lose the CPU (measured: README, "Served path"). A caller's RAY_worker_niceness wins.
    """
    from cluster.slow_clients import proxy_env

    limits = cfg.limits
    env = dict(proxy_env(limits.read_timeout_s, limits.max_header_bytes, limits.write_stall_timeout_s))
    env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] = str(cfg.limits.grpc_message_bytes)
    env[WORKER_NICENESS_ENV] = os.environ.get(WORKER_NICENESS_ENV, "0")
    if cfg.server.host in ("127.0.0.1", "localhost", "::1"):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        print("warning: RAY_AUTH_MODE=disabled: the local Ray cluster accepts unauthenticated clients", file=sys.stderr)
        return env
    import atexit
    import secrets
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="logitpool-ray-auth-", dir=token_dir))  # mode 0700
    atexit.register(shutil.rmtree, directory, True)  # the token lives as long as this cluster
    token = directory / "auth_token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    os.environ.pop("RAY_AUTH_TOKEN", None)
    return env


def _report(line: str) -> None:
    print(f"  serve: {line}", file=sys.stderr, flush=True)


def start_serve(cfg: Any, address: str | None = None, *, report: Any = _report) -> Any:
    """Start/join Ray, start Serve's HTTP and gRPC proxies, deploy; returns the resolved config."""
    if address is None and "ray" not in sys.modules:
        os.environ.update(local_cluster_env(cfg))
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from cluster.deploy.serve_config import GRPC_SERVICER_FUNCTIONS

    if not ray.is_initialized():
        if address is None:
            cpus = cfg.local_worker_cpus(os.cpu_count() or 1)
            if cpus != cfg.worker_cpus:
                cfg = cfg.with_overrides(**{"workers.num_cpus": cpus})
                report(f"a CPU worker on this machine: {cpus:g} CPUs per replica (torch threads; workers.num_cpus)")
            # A local cluster: logical CPUs are scheduling slots, not cores; leave room for the
            # ingress and a few worker replicas even on a 2-core laptop. Nothing listens beyond
            # the node address (see local_cluster_env); the dashboard is off.
            ray.init(
                num_cpus=max(os.cpu_count() or 1, LOCAL_NUM_CPUS),
                include_dashboard=False,
                log_to_driver=False,
                dashboard_host="127.0.0.1",
            )
        else:
            ray.init(address=address, log_to_driver=False)
    serve.start(
        http_options={"host": cfg.server.host, "port": cfg.server.http_port},
        grpc_options=gRPCOptions(port=cfg.server.grpc_port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS)),
    )
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::") else cfg.server.host
    return deploy(cfg, report=report, serving=lambda: healthy(host, cfg.server.http_port))


def deploy(
    cfg: Any, *, timeout_s: float = READY_TIMEOUT_S, report: Any = _report, serving: Any = None, **build: Any
) -> Any:
    """(Re)deploy the application on a running Serve instance and wait until Serve runs it (a
    replica's start-up failure raises with its cause); returns the resolved config. ``build``:
    more arguments of `cluster.app.build_app`."""
    from ray.serve.api import _run

    from cluster.app import build_app, resolve_model
    from cluster.cli.deploy_wait import quiet_serve_start, wait_running

    cfg = resolve_model(cfg)
    with quiet_serve_start():
        _run(build_app(cfg, **build), _blocking=False, name=cfg.app_name, route_prefix=cfg.route_prefix)
    pending = wait_running(cfg.app_name, timeout_s, report=report, serving=serving or (lambda: False))
    for line in pending:
        print(
            f"warning: serving, but not every replica has started (see `logitpool status`): {line}",
            file=sys.stderr,
            flush=True,
        )
    return cfg


def healthy(host: str, port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://{host}:{port}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(host: str, port: int, timeout_s: float = READY_TIMEOUT_S) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise CliError(f"logitpool did not become healthy within {timeout_s:.0f}s (http://{host}:{port}/health)")

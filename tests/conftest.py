"""Shared fixtures: the tiny real model (built once, cached on disk) and one Ray cluster per session."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from hypothesis import settings

# The test clusters run without Ray token auth: many short-lived local clusters, loopback only
# (`logitpool serve` turns it on; tests/cluster/test_side_doors.py checks that).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Serve's HTTP proxy in the session cluster gets the request read timeout (cluster.slow_clients),
# short so the slowloris test is quick; set before Ray starts, its processes inherit it.
TEST_READ_TIMEOUT_S = 4.0
os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "cluster.slow_clients:install")
os.environ.setdefault("LOGITPOOL_HTTP_READ_TIMEOUT_S", str(TEST_READ_TIMEOUT_S))
# Test-only worker hooks (LogitpoolWorker.debug_kill_engine) for the engine-death test.
os.environ.setdefault("LOGITPOOL_DEBUG_HOOKS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Serve says replicas wait to be scheduled after 5 s, not 30 (tests/cluster/test_operator.py).
os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_S", "5")
# ... and says it every second, not every 30 s: Serve shows one message at a time, and a replica
# still initializing hides the pending one until the next warning (its default period: 30 s).
os.environ.setdefault("RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S", "1")

# Property tests assert results, never speed: hypothesis's per-example deadline (200 ms) fails on
# a loaded 2-core CI box, so it is off for the whole suite (benchmarks measure speed).
settings.register_profile("logitpool", deadline=None)
settings.load_profile("logitpool")

REPO_ROOT = Path(__file__).resolve().parent.parent
PLUGIN_SITE = REPO_ROOT / "tests" / "fixtures" / "plugin_site"

from tests.worker.model_fixtures import tiny_loaded, tiny_model, tiny_model_dir, tiny_model_path  # noqa: E402,F401 - fixtures pytest finds by name, after the profile above


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_ports(ray_cluster) -> tuple[int, int]:
    """Serve's HTTP and gRPC proxies, started once; test modules deploy their apps onto them."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from cluster.deploy.serve_config import GRPC_SERVICER_FUNCTIONS

    http_port, grpc_port = free_port(), free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": http_port},
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS)),
    )
    return http_port, grpc_port


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (tests/fixtures importable in its workers)."""
    import ray

    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=8,
        num_gpus=2,  # declared only: GPU placement is tested without GPUs (tests/cluster/test_operator.py)
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": pythonpath,
                "RAY_AUTH_MODE": "disabled",
                "LOGITPOOL_DEBUG_HOOKS": "1",
                "LOGITPOOL_CACHE": os.environ.get("LOGITPOOL_CACHE", ""),
            }
        },
    )
    yield ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


# Clients of a module's deployment: each serving test module defines its own `serving` fixture
# (a LogitpoolConfig it deployed); these resolve it per module.


@pytest.fixture(scope="module")
def oai(serving):
    """The official openai SDK pointed at the module's deployment."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{serving.server.http_port}/v1", api_key="unused", timeout=60)


@pytest.fixture(scope="module")
def grpc_client(serving):
    """The client library over gRPC to the module's deployment."""
    from client import Client

    with Client(f"127.0.0.1:{serving.server.grpc_port}", timeout=60) as c:
        yield c

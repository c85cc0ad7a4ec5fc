"""What serving test modules share: one deployed app per module, a raw JSON POST, and the
OpenAI-shaped error a rejected request must carry."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.config import LogitpoolConfig

# Serve's replicas, told to stop, look for ongoing requests every graceful_shutdown_wait_loop_s
# (default 2 s), the first time only after one such wait: every app deleted or scaled down here
# would idle that long. They still wait for every ongoing request (graceful_shutdown_timeout_s).
DRAIN_LOOP_S = 0.2


def deploy(cfg: LogitpoolConfig, **kw: Any) -> LogitpoolConfig:
    """`cluster.cli.launch.deploy`, its deployments checking for ongoing requests every
    DRAIN_LOOP_S when they stop."""
    import cluster.app
    from cluster.cli import launch

    options = cluster.app.deployment_options

    def quick_drain(*args: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
        opts = options(*args, **kwargs)
        return {name: {**o, "graceful_shutdown_wait_loop_s": DRAIN_LOOP_S} for name, o in opts.items()}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cluster.app, "deployment_options", quick_drain)
        return launch.deploy(cfg, **kw)


def deployed(
    serve_ports: tuple[int, int], model_dir: Path, app_name: str, engine: dict[str, Any], **sections: Any
) -> Iterator[LogitpoolConfig]:
    """Deploy the tiny model as `app_name` on the session's Serve proxies, one worker replica;
    `engine` and `sections` (limits, api_keys, ...) add to that. Deleted afterwards."""
    from ray import serve

    from cluster.cli.launch import wait_ready

    cfg = LogitpoolConfig.model_validate(
        {
            "engine": {"model": str(model_dir), **engine},
            "workers": {"num_replicas": 1},
            "server": {"http_port": serve_ports[0], "grpc_port": serve_ports[1]},
            "app_name": app_name,
            **sections,
        }
    )
    deploy(cfg)
    wait_ready("127.0.0.1", serve_ports[0], timeout_s=180)
    yield cfg
    serve.delete(app_name)


def post(
    base: str, body: Any, path: str = "/v1/completions", *, headers: dict[str, str] | None = None, timeout: float = 60
) -> httpx.Response:
    """`body` sent as given when bytes or str, else as JSON; content type JSON unless `headers` say."""
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        base + path, content=content, headers={"content-type": "application/json", **(headers or {})}, timeout=timeout
    )


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    """The response's OpenAI-shaped error (JSON whatever the status)."""
    assert r.status_code == status, r.text[:300]
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code", "param"}
    return err

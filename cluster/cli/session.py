"""The running `logitpool serve` a later command (`status`, `scale`) talks to.

`logitpool serve` writes a small session file (mode 0600, removed on exit): the Ray cluster's
address, the environment a driver needs to join it (its token file when Ray token auth is on)
and the deployed config. `status` and `scale` join that cluster as Ray drivers; nothing new
listens anywhere."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from cluster.cli.errors import CliError

# What a joining driver needs of `local_cluster_env` (the rest concerns the processes Ray starts).
_JOIN_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def default_path() -> Path:
    """`$LOGITPOOL_CACHE/serve-session.json`, else `~/.cache/logitpool/serve-session.json`."""
    root = os.environ.get("LOGITPOOL_CACHE") or Path.home() / ".cache" / "logitpool"
    return Path(root) / "serve-session.json"


def owned_by_another(path: Path) -> bool:
    """True while another live `logitpool serve` owns the session file at `path`."""
    try:
        pid = int(json.loads(path.read_text())["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return pid != os.getpid()


def write(path: Path, address: str, config: dict[str, Any]) -> None:
    env = {k: os.environ[k] for k in _JOIN_ENV if k in os.environ}
    update(path, {"pid": os.getpid(), "address": address, "env": env, "config": config})


def update(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    tmp.replace(path)


def remove(path: Path) -> None:
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CliError(f"no running `logitpool serve` found ({path} does not exist); start one first") from None
    except (OSError, ValueError) as exc:
        raise CliError(f"{path}: unreadable session file ({exc})") from None
    try:
        os.kill(int(data["pid"]), 0)
    except (KeyError, ValueError, ProcessLookupError):
        raise CliError(f"the `logitpool serve` that wrote {path} is no longer running") from None
    except PermissionError:
        pass
    return data


def join(path: Path) -> dict[str, Any]:
    """Join the session's Ray cluster as a driver; returns the session (its deployed config)."""
    data = read(path)
    os.environ.update(data.get("env", {}))
    import ray

    if not ray.is_initialized():
        ray.init(address=data["address"], log_to_driver=False, logging_level=logging.ERROR)
    return data

"""Waiting for a Serve application with Serve's own account of what holds it up.

`serve.run` waits without a bound and, when a replica's constructor fails, says only "Failed to
update the deployments"; the cause is in the deployment's status message (the replica's
traceback). Here the wait is bounded, a failure raises with that cause, and a message about
replicas that cannot be scheduled (no node has the GPUs they ask for) is reported, not waited on
for ever once the application already serves."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from cluster.cli.errors import CliError

if TYPE_CHECKING:
    from ray.serve.schema import ApplicationStatusOverview

POLL_S = 1.0
_FAILED = ("DEPLOY_FAILED", "UNHEALTHY")
# Serve's message for replicas not yet placed ("... taken more than 30s to be scheduled ...
# Resources required for each replica: {...}, total resources available: {...}").
_RESOURCES = re.compile(r"Resources required for each replica: (\{.*?\}), total resources available: (\{.*?\})")


def unplaceable(message: str) -> bool:
    """Serve says a replica waits for resources the cluster has not got free (not merely slow)."""
    m = _RESOURCES.search(message)
    if m is None:
        return False
    try:
        required, available = json.loads(m.group(1)), json.loads(m.group(2))
        return any(float(v) > float(available.get(k, 0.0)) for k, v in required.items())
    except (ValueError, TypeError, AttributeError):
        return False


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:")
CAUSE_CHARS = 400


def cause(message: str) -> str:
    """A deployment message on one line: from a traceback, its last exception and what follows."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "no message from Serve"
    starts = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
    text = " ".join(lines[starts[-1] :] if starts else lines)
    return text if len(text) <= CAUSE_CHARS else text[:CAUSE_CHARS] + "..."


def _value(status: object) -> str:
    return str(getattr(status, "value", status))


def app_status(app: str) -> ApplicationStatusOverview | None:
    from ray import serve

    return serve.status().applications.get(app)


def wait_running(
    app: str,
    timeout_s: float,
    *,
    report: Callable[[str], None] = lambda _: None,
    serving: Callable[[], bool] = lambda: False,
) -> list[str]:
    """Wait until `app` is RUNNING; returns Serve's messages about unschedulable replicas when
    it gave up waiting for those because `serving()` says requests are already answered."""
    deadline = time.monotonic() + timeout_s
    seen: set[tuple[str, str]] = set()
    stale: set[tuple[str, str]] | None = None  # messages of the previous deployment, still shown
    while True:
        st = app_status(app)
        if st is None:
            raise CliError(f"application {app!r}: not deployed")
        if _value(st.status) == "RUNNING":
            return []
        messages = {name: d.message for name, d in st.deployments.items() if d.message}
        failed = {name: m for name, m in messages.items() if _value(st.deployments[name].status) in _FAILED}
        if failed or _value(st.status) == "DEPLOY_FAILED":
            why = "; ".join(f"{name}: {cause(m)}" for name, m in failed.items()) or cause(st.message)
            raise CliError(f"deployment failed: {why}")
        for name, m in messages.items():
            if (name, m) not in seen:
                seen.add((name, m))
                report(f"{name}: {cause(m)}")
        if stale is None:
            stale = set(messages.items())
        pending = [f"{name}: {cause(m)}" for name, m in messages.items() if unplaceable(m) and (name, m) not in stale]
        if pending and serving():
            return pending
        if time.monotonic() > deadline:
            why = "; ".join(f"{name}: {cause(m)}" for name, m in messages.items()) or _value(st.status)
            raise CliError(f"application {app!r} not running after {timeout_s:.0f}s: {why}")
        time.sleep(POLL_S)


class _DropRestartNotice(logging.Filter):
    """Serve's "New http_options ... will not be applied": true of every `serve.run` after our
    own `serve.start`, and misleading there (the options given to serve.start did apply)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will not be applied" not in record.getMessage()


@contextmanager
def quiet_serve_start() -> Iterator[None]:
    log = logging.getLogger("ray.serve")
    notice = _DropRestartNotice()
    log.addFilter(notice)
    try:
        yield
    finally:
        log.removeFilter(notice)

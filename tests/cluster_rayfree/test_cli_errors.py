"""What an operator sees when a CLI command fails, and `logitpool status`'s text (no Ray needed:
every failure here happens before Ray starts, which is the point)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cluster.cli.deploy_wait import cause
from cluster.cli.errors import CliError
from cluster.cli.main import banner, main
from cluster.cli.status_view import status_lines
from cluster.config import LogitpoolConfig
from cluster.pool_stats import PoolSnapshot

REPO = Path(__file__).resolve().parents[2]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize(
    ("files", "argv", "says"),
    [
        ({"c.yaml": "engine: {modle: x}\n"}, ["serve", "--config", "{d}/c.yaml"], "config: engine.modle: Extra inputs"),
        ({"c.yaml": "engine: [\n"}, ["serve", "--config", "{d}/c.yaml"], "config: not valid YAML"),
        ({"c.yaml": "workers: {num_replicas: 0}\n"}, ["serve", "--config", "{d}/c.yaml"], "workers.num_replicas"),
        ({}, ["serve", "--config", "{d}/missing.yaml"], "no such file: "),
        ({}, ["serve", "--model", "{d}/no-model"], "model: no such directory"),
        ({}, ["serve", "--logits-processors", "nosuch.module:Cls"], "module 'nosuch.module' could not be imported"),
        ({}, ["serve", "--logits-processors", "tests.fixtures.seed_processors:Missing"], "Missing"),
        ({}, ["generate", "hi", "--extra-args", "{oops"], "--extra-args: not valid JSON"),
        ({}, ["generate", "hi", "--target", "127.0.0.1:1", "--timeout", "3"], "127.0.0.1:1: Unavailable"),
        ({}, ["status", "--session", "{d}/none.json"], "no running `logitpool serve` found"),
        ({}, ["scale", "2", "--session", "{d}/none.json"], "no running `logitpool serve` found"),
    ],
)
def test_errors_are_one_line_exit_2(tmp_path, capsys, files, argv, says):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    rc, err = run_cli(capsys, *(a.replace("{d}", str(tmp_path)) for a in argv))
    assert rc == 2
    (line,) = err.strip().splitlines()
    assert line.startswith("logitpool: error: ") and says in line, line


def test_debug_adds_the_traceback(tmp_path, capsys):
    rc, err = run_cli(capsys, "serve", "--config", str(tmp_path / "missing.yaml"), "--debug")
    assert rc == 2 and "Traceback (most recent call last)" in err and err.strip().endswith("missing.yaml")


def test_bad_processor_fails_in_seconds_without_ray():
    """In a fresh process, as an operator runs it: the import error, and Ray never imported."""
    code = (
        "import sys; from cluster.cli.main import main; rc = main(['serve', '--logits-processors', 'nosuch.mod:C']);"
        "assert 'ray' not in sys.modules; sys.exit(rc)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    assert "No module named 'nosuch'" in r.stderr and "Traceback" not in r.stderr


def test_cause_is_the_traceback_exception():
    message = (
        "The deployment failed to start 3 times in a row. Error:\nray::ServeReplica.init()\n"
        '  File "w.py", line 3, in f\n    raise ValueError(\nValueError: bad model in /m:\n(1) no config\n'
    )
    assert cause(message) == "ValueError: bad model in /m: (1) no config"
    assert (
        cause("1 replicas have taken more than 30s to be scheduled.")
        == "1 replicas have taken more than 30s to be scheduled."
    )


def test_banner_with_keys_shows_how_to_send_one():
    cfg = LogitpoolConfig.model_validate({"engine": {"model": "/srv/m"}, "api_key_env": "MY_KEYS"})
    lines = banner(cfg, "127.0.0.1", keys=True)
    text = "\n".join(lines)
    assert "${MY_KEYS%%,*}" in text  # the variable is shown, never a key
    # Run as printed by a POSIX shell (curl and the CLI stubbed to print their arguments): with
    # several comma-separated keys, the first one is sent.
    curl = next(line for line in lines if line.strip().startswith("curl "))
    generate = next(line for line in lines if " generate " in line).split(" generate ", 1)[1]
    script = f"curl() {{ printf '%s\\n' \"$@\"; }}\n{curl}\nprintf '%s\\n' {generate}\n"
    out = subprocess.run(
        ["sh", "-c", script],
        env={"MY_KEYS": "k1,k2", "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert "Authorization: Bearer k1" in out and out[out.index("--api-key") + 1] == "k1"
    assert "'m'" in text  # the served name, not the path
    assert "Authorization" not in "\n".join(banner(cfg, "127.0.0.1", keys=False))


def test_status_lines_show_pending_replicas_and_engine_load():
    worker = SimpleNamespace(
        status="UPDATING",
        replica_states={"RUNNING": 2, "STARTING": 1},
        message="Deployment has 1 replicas that have taken more than 30s to be scheduled.",
    )
    ingress = SimpleNamespace(status="HEALTHY", replica_states={"RUNNING": 1}, message="")
    st = SimpleNamespace(status="DEPLOYING", deployments={"LogitpoolWorker": worker, "LogitpoolIngress": ingress})
    kv = {"blocks_used": 8192.0, "blocks_free": 8191.0, "blocks_total": 16383.0, "prefix_hit_rate": 0.25}
    snaps = [
        PoolSnapshot(
            replica_id="b", alive=True, heartbeat_age_s=0.1, num_running=3, num_waiting=1, kv=kv, kv_cache_bytes=3 << 30
        ),
        PoolSnapshot(replica_id="a", alive=False, heartbeat_age_s=70.0, num_running=0, num_waiting=0),
    ]
    lines = status_lines("logitpool", st, snaps)
    assert lines[0] == "application logitpool: DEPLOYING"
    assert "  LogitpoolWorker: UPDATING  replicas: RUNNING=2 STARTING=1" in lines
    assert any("to be scheduled" in line for line in lines)
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("replica"))
    assert [h.strip() for h in lines[head].split("  ") if h.strip()] == [
        "replica",
        "alive",
        "running",
        "waiting",
        "kv used",
        "kv free",
        "kv total",
        "prefix hits",
        "kv memory",
    ]
    rows = [line.split() for line in lines[head + 1 :]]
    # Integers print as integers (no 8.19e+03), rows sorted by replica, every column aligned.
    assert rows == [
        ["a", "NO", "0", "0", "-", "-", "-", "-", "-"],
        ["b", "yes", "3", "1", "8,192", "8,191", "16,383", "25.0%", "3.0", "GiB"],
    ]
    # Aligned: every numeric column ends at the same offset in the header and in each row.
    assert lines[head].index("running") + len("running") == lines[head + 2].index(" 3 ") + 2
    assert "e+" not in "\n".join(lines)
    assert status_lines("x", None, []) == ["application x: not deployed"]


def _app(status: str, **deployments: tuple[str, str]) -> SimpleNamespace:
    return SimpleNamespace(
        status=status,
        message="",
        deployments={
            name: SimpleNamespace(status=s, message=m, replica_states={}) for name, (s, m) in deployments.items()
        },
    )


def test_wait_running_reports_then_fails_with_the_cause(monkeypatch):
    from cluster.cli import deploy_wait

    states = iter(
        [
            _app("DEPLOYING", W=("UPDATING", "A replica failed to start. Error:\nValueError: bad model\n")),
            _app("DEPLOY_FAILED", W=("DEPLOY_FAILED", "failed 3 times. Error:\nValueError: bad model\n")),
        ]
    )
    monkeypatch.setattr(deploy_wait, "app_status", lambda app: next(states))
    monkeypatch.setattr(deploy_wait, "POLL_S", 0.0)
    reported: list[str] = []
    with pytest.raises(CliError, match=r"^deployment failed: W: ValueError: bad model$"):
        deploy_wait.wait_running("a", 10, report=reported.append)
    assert reported == ["W: ValueError: bad model"]


def test_wait_running_stops_waiting_for_unplaceable_replicas_once_serving(monkeypatch):
    from cluster.cli import deploy_wait

    msg = (
        "Deployment 'W' has 1 replicas that have taken more than 30s to be scheduled. Resources required for "
        'each replica: {"CPU": 0.5, "GPU": 1.0}, total resources available: {"CPU": 6.0}. Use `ray status`.'
    )
    fresh = iter([_app("DEPLOYING", W=("UPDATING", ""))] + [_app("DEPLOYING", W=("UPDATING", msg))] * 2)
    monkeypatch.setattr(deploy_wait, "app_status", lambda app: next(fresh))
    monkeypatch.setattr(deploy_wait, "POLL_S", 0.0)
    assert deploy_wait.wait_running("a", 10, serving=lambda: True) == [f"W: {msg}"]
    # A message already shown when the wait starts belongs to the previous deployment: waited on.
    monkeypatch.setattr(deploy_wait, "app_status", lambda app: _app("DEPLOYING", W=("UPDATING", msg)))
    with pytest.raises(CliError, match="not running after 0s: W: Deployment 'W' has 1 replicas"):
        deploy_wait.wait_running("a", 0, serving=lambda: True)


def test_only_replicas_short_of_resources_count_as_unplaceable():
    from cluster.cli.deploy_wait import unplaceable

    slow = (
        "has 1 replicas that have taken more than 5s to be scheduled. Resources required for each replica: "
        '{"CPU": 1.0}, total resources available: {"CPU": 6.0}.'
    )
    assert not unplaceable(slow) and not unplaceable("taken more than 5s to initialize")
    assert unplaceable(slow.replace('{"CPU": 1.0}', '{"CPU": 1.0, "GPU": 1.0}'))

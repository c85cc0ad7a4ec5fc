"""The CLI's flags map onto LogitpoolConfig (no Ray needed)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.main import _serve_parser, build_config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="cmd"), argparse.ArgumentParser(add_help=False))
    return parser.parse_args(["serve", *argv])


def test_defaults_are_the_embedded_local_setup():
    cfg = build_config(parse())
    assert cfg.engine.model is None and cfg.workers.num_gpus == 0
    assert (cfg.server.host, cfg.server.http_port, cfg.server.grpc_port) == ("127.0.0.1", 8000, 9000)


def test_flags_override_the_config():
    cfg = build_config(
        parse(
            "--model",
            "m",
            "--logits-processors",
            "a.b:C",
            "d.e:F",
            "--num-replicas",
            "3",
            "--http-port",
            "8100",
            "--grpc-port",
            "9100",
            "--host",
            "0.0.0.0",
            "--tensor-parallel-size",
            "2",
        )
    )
    assert cfg.engine.model == "m" and cfg.engine.logits_processors == ("a.b:C", "d.e:F")
    assert cfg.engine.tensor_parallel_size == 2 and build_config(parse()).engine.tensor_parallel_size == 1
    assert cfg.workers.num_replicas == 3 and cfg.workers.autoscaling is None
    assert (cfg.server.host, cfg.server.http_port, cfg.server.grpc_port) == ("0.0.0.0", 8100, 9100)
    auto = build_config(parse("--autoscale", "1", "4"))
    assert auto.workers.num_replicas is None
    assert (auto.workers.autoscaling.min_replicas, auto.workers.autoscaling.max_replicas) == (1, 4)


def test_joining_a_cluster_defaults_to_one_gpu_per_replica(tmp_path):
    assert build_config(parse("--address", "auto")).workers.num_gpus == 1
    assert build_config(parse("--address", "auto", "--num-gpus", "0")).workers.num_gpus == 0
    f = tmp_path / "c.yaml"
    f.write_text("workers:\n  num_gpus: 0.5\n")
    assert build_config(parse("--address", "auto", "--config", str(f))).workers.num_gpus == 0.5


def test_bad_flags_fail_with_the_field_named():
    with pytest.raises(ValueError, match="grpc_port"):
        build_config(parse("--http-port", "9000", "--grpc-port", "9000"))


def test_a_local_cluster_gets_a_fresh_private_token_and_loopback(tmp_path, monkeypatch):
    from cluster.cli.launch import local_cluster_env

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    cfg = build_config(parse())
    first, second = local_cluster_env(cfg, tmp_path), local_cluster_env(cfg, tmp_path)
    assert first["RAY_AUTH_MODE"] == "token" and first["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    tokens = [Path(env["RAY_AUTH_TOKEN_PATH"]) for env in (first, second)]
    assert tokens[0].read_text() != tokens[1].read_text() and len(tokens[0].read_text()) == 64
    assert all(t.stat().st_mode & 0o777 == 0o600 and t.parent.stat().st_mode & 0o777 == 0o700 for t in tokens)
    assert first["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "cluster.slow_clients:install"
    assert float(first["LOGITPOOL_HTTP_READ_TIMEOUT_S"]) == cfg.limits.read_timeout_s
    assert int(first["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]) == cfg.limits.grpc_message_bytes == 4 << 20
    assert first["RAY_worker_niceness"] == "0"  # serving processes at normal priority
    monkeypatch.setenv("RAY_worker_niceness", "5")
    assert local_cluster_env(cfg, tmp_path)["RAY_worker_niceness"] == "5"  # the caller's choice wins
    monkeypatch.delenv("RAY_worker_niceness")
    wide = local_cluster_env(build_config(parse("--host", "0.0.0.0")), tmp_path)
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in wide and wide["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # honoured (the test suite's own clusters), warned about
    assert "RAY_AUTH_MODE" not in local_cluster_env(cfg, tmp_path)


def test_generate_into_a_closed_pipe_ends_quietly():
    """`logitpool generate ... | head -c 3`: the reader leaves early; no traceback, no error line."""
    from tests.client.fake_server import FakeLogitPool, serve

    with serve(FakeLogitPool(delay=0.02)) as running:
        cli = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "generate", "hi", "--target", running.target, "--max-tokens", "400"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert cli.stdout is not None and cli.stderr is not None
        first = cli.stdout.read(3)  # like `head -c 3`, then the reader is gone
        cli.stdout.close()
        err = cli.stderr.read().decode()
        rc = cli.wait(timeout=120)
    assert first
    assert err == "", err
    assert rc == 141  # 128 + SIGPIPE, as a Unix tool whose reader went away


def test_scaling_down_keeps_cache_aware_routing_so_no_worker_restarts() -> None:
    """An unset ``routing.policy`` defaults by the pool's size, and the workers' bind arguments
    follow it (they publish cached blocks only under cache-aware routing), so Serve redeploys
    every worker when it flips: ``logitpool scale 1`` on a pool of three restarted all of them
    (about 25 s measured). Scaling down now keeps the policy; an explicit one is kept as set."""
    from cluster.cli.main import scaled_config
    from cluster.config import LogitpoolConfig
    from cluster.deploy.serve_config import routing_policy

    three = LogitpoolConfig.model_validate({"workers": {"num_replicas": 3}})
    assert routing_policy(three) == "cache_aware"
    one = scaled_config(three, 1)
    assert one.workers.num_replicas == 1 and routing_policy(one) == "cache_aware"
    assert one.routing.max_published_blocks == three.routing.max_published_blocks
    up = scaled_config(LogitpoolConfig(), 3)  # from one replica: the default for three
    assert up.workers.num_replicas == 3 and routing_policy(up) == "cache_aware"
    chosen = {"workers": {"num_replicas": 3}, "routing": {"policy": "power_of_two"}}
    assert routing_policy(scaled_config(LogitpoolConfig.model_validate(chosen), 1)) == "power_of_two"

"""The CLI's flags map onto LogitpoolConfig (no Ray needed)."""

from __future__ import annotations

import argparse

import pytest

from cluster.cli import _serve_parser, build_config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["serve", *argv])


def test_defaults_are_the_embedded_local_setup():
    cfg = build_config(parse())
    assert cfg.engine.model is None and cfg.workers.num_gpus == 0
    assert (cfg.server.host, cfg.server.http_port, cfg.server.grpc_port) == ("127.0.0.1", 8000, 9000)


def test_flags_override_the_config():
    cfg = build_config(parse("--model", "m", "--logits-processors", "a.b:C", "d.e:F", "--num-replicas", "3",
                             "--http-port", "8100", "--grpc-port", "9100", "--host", "0.0.0.0"))
    assert cfg.engine.model == "m" and cfg.engine.logits_processors == ("a.b:C", "d.e:F")
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

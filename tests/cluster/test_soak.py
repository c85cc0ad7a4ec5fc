"""The soak with faults, short: random valid traffic over HTTP and gRPC (some of it with fresh
trivial constraints) with 10 % hostile requests, 10 % client cancellations, 1 % requests whose
processor raises, issue 17's hostile classes (amplifying, heavy-grammar pairs, hogs at the
sequence limits, streams whose client stops reading; cluster/cli/soak_classes.py), and one worker
replica killed (SIGKILL) halfway. Every request must end exactly once with an outcome allowed for
its kind; innocents fail only when in flight on the killed replica; batches end empty; the
surviving worker replica's and the ingress's RSS grow < 5 % after warm-up. `logitpool bench soak`
runs the same with 5,000 (the new classes capped in count)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.cli.bench_soak import CANCEL, FAULT, HOSTILE, INNOCENT, soak_config, soak_deployment
from cluster.cli.soak_classes import NEW_CLASSES

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "soak"


@pytest.fixture(scope="module")
def soak_target(serve_ports, tiny_model_dir):
    from ray import serve

    from cluster.cli.launch import wait_ready
    from tests.cluster.serving_helpers import deploy

    cfg = deploy(soak_config(str(tiny_model_dir), *serve_ports, app=APP, max_num_seqs=16))
    wait_ready("127.0.0.1", cfg.server.http_port, timeout_s=180)
    yield cfg
    serve.delete(APP)


def test_soak_with_faults(soak_target):
    cfg = soak_target
    report = asyncio.run(
        soak_deployment(
            f"http://127.0.0.1:{cfg.server.http_port}",
            f"127.0.0.1:{cfg.server.grpc_port}",
            APP,
            requests=240,
            concurrency=16,
            seed=3,
            warmup=64,
            limits=cfg.limits,
            stall_hold_s=3.0,
        )
    )
    print(report.render())
    assert len(report.outcomes) == 240  # exactly one outcome per request
    kinds = {o.kind for o in report.outcomes}
    assert kinds == {INNOCENT, HOSTILE, CANCEL, FAULT, *NEW_CLASSES}, kinds
    assert any(o.name.endswith("_constrained") for o in report.outcomes if o.kind == INNOCENT)
    assert report.kill_time is not None, "no replica was killed (fewer than two replicas seen)"
    assert "ingress" in report.roles.values() and len(report.rss_warm) >= 2  # RSS of the ingress and a worker
    bad = report.violations()
    print("\n".join(f"VIOLATION {line}" for line in bad))
    assert bad == []

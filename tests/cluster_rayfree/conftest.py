"""The cluster's tests that need no Ray: the front end on a fake engine, config, CLI, protocol.

A guard keeps them so: a test here that asks for the session's Ray cluster (or Serve's
proxies) fails at setup, and one that calls ``ray.init``, ``serve.start`` or ``serve.run``
itself fails there (``serve.run(..., _local_testing_mode=True)`` runs in this process without
Ray and is allowed). Tests that need Ray live in tests/cluster/.
"""

from __future__ import annotations

from typing import Any, NoReturn

import pytest

_RAY_FIXTURES = frozenset({"ray_cluster", "serve_ports"})


def _refuse(*_args: object, **_kwargs: object) -> NoReturn:
    raise AssertionError("tests/cluster_rayfree/ starts no Ray: move this test to tests/cluster/")


@pytest.fixture(autouse=True)
def _no_ray(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    wanted = _RAY_FIXTURES.intersection(request.fixturenames)
    assert not wanted, f"{request.node.nodeid} asks for {sorted(wanted)}: it belongs in tests/cluster/"
    import ray
    from ray import serve

    run = serve.run

    def run_locally_only(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("_local_testing_mode"):
            _refuse()
        return run(*args, **kwargs)

    monkeypatch.setattr(ray, "init", _refuse)
    monkeypatch.setattr(serve, "start", _refuse)
    monkeypatch.setattr(serve, "run", run_locally_only)

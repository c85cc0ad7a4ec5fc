"""The folder's guard refuses Ray (tests/cluster_rayfree/conftest.py)."""

from __future__ import annotations

import pytest


def test_ray_init_is_refused_here():
    import ray

    with pytest.raises(AssertionError, match="starts no Ray"):
        ray.init(num_cpus=1)
    # (ray.is_initialized() may still be true here: tests/cluster/ runs first and its session
    # cluster lives until the session ends; what this folder guarantees is that it starts none.)


def test_serve_start_and_run_are_refused_here():
    from ray import serve

    with pytest.raises(AssertionError, match="starts no Ray"):
        serve.start()
    with pytest.raises(AssertionError, match="starts no Ray"):
        serve.run(None)


def test_asking_for_the_ray_cluster_fails_at_setup(pytester: pytest.Pytester):
    pytester.makeconftest("import pytest\npytest_plugins = []\n@pytest.fixture\ndef ray_cluster():\n    yield None\n")
    guard = (__import__("pathlib").Path(__file__).with_name("conftest.py")).read_text()
    sub = pytester.mkpydir("inner")
    (sub / "conftest.py").write_text(guard)
    (sub / "test_uses_ray.py").write_text("def test_x(ray_cluster):\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", str(sub))
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*belongs in tests/cluster/*"])

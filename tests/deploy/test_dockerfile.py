"""cluster/Dockerfile, statically: base, install order, what it copies, ports and name vs the chart."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "cluster" / "Dockerfile"
CHART = REPO / "helm" / "logitpool"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for raw in joined.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def args_of(op: str) -> list[str]:
    return [rest for o, rest in instructions() if o == op]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def chart_meta() -> dict:
    return yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))


def ray_pin(pyproject: dict) -> str:
    (spec,) = [d for d in pyproject["project"]["optional-dependencies"]["serve"] if d.startswith("ray[")]
    return spec.split("==")[1]


def test_base_is_the_pinned_ray_gpu_image(pyproject: dict, values: dict) -> None:
    (base,) = args_of("FROM")
    assert base == f"rayproject/ray:{ray_pin(pyproject)}-py311-gpu"
    assert values["rayVersion"] == ray_pin(pyproject)


def test_installs_torch_then_the_package_with_serve_extras() -> None:
    runs = args_of("RUN")
    torch = [i for i, r in enumerate(runs) if re.search(r"pip install .*torch==2\.13\.0", r)]
    package = [i for i, r in enumerate(runs) if re.search(r"pip install \"?\.\[serve[^\]]*\]\"?", r)]
    assert torch and package and torch[0] < package[0]
    assert "--editable" not in runs[package[0]] and " -e " not in runs[package[0]]


def test_copies_every_package_and_the_protos_exist_as_packages() -> None:
    copied: set[str] = set()
    for rest in args_of("COPY"):
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        copied.update(parts[:-1])
    for needed in ["pyproject.toml", "README.md", "worker", "cluster", "client", "protos"]:
        assert needed in copied, needed
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: not in the repository, the build would fail"
    # Generated modules Serve's gRPC proxy imports must be regular packages so the install ships them.
    pb = REPO / "client" / "pb"
    for package in [pb, pb / "logitpool", pb / "logitpool" / "v1"]:
        assert (package / "__init__.py").is_file(), package
    assert (pb / "logitpool" / "v1" / "logitpool_pb2_grpc.py").is_file()


def test_build_checks_the_proxy_imports() -> None:
    (install,) = [r for r in args_of("RUN") if ".[serve" in r]
    for module in ["cluster.app", "client.pb.logitpool.v1.logitpool_pb2_grpc", "grpc_health.v1.health_pb2_grpc"]:
        assert module in install


def test_exposed_ports_are_the_charts(values: dict) -> None:
    exposed = {int(p.split("/")[0]) for rest in args_of("EXPOSE") for p in rest.split()}
    assert exposed == set(values["ports"].values())


def test_image_name_and_version_match_the_chart(values: dict, chart_meta: dict, pyproject: dict) -> None:
    labels = dict(re.findall(r'(\S+?)="([^"]*)"', " ".join(args_of("LABEL"))))
    assert labels["org.opencontainers.image.title"] == values["image"]["repository"]
    assert labels["org.opencontainers.image.version"] == chart_meta["appVersion"] == pyproject["project"]["version"]
    # Empty tag in values = the chart's appVersion = the image this Dockerfile builds.
    assert values["image"]["tag"] == ""

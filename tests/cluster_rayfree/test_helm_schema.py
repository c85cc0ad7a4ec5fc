"""The Helm values schema is generated from the config model: checked-in equals generated, the
chart's values files validate against it, and it enforces the model's bounds (no Ray, no helm)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.config import LogitpoolConfig
from cluster.deploy.helm_schema import CHART, SCHEMA, VALUES_TO_CONFIG, generate, main, render
from worker.config import EngineConfig


def _validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads(SCHEMA.read_text(encoding="utf-8")))


def _values(name: str = "values.yaml") -> dict[str, Any]:
    return yaml.safe_load((CHART / name).read_text(encoding="utf-8"))


def test_checked_in_schema_is_the_generated_one() -> None:
    assert SCHEMA.read_text(encoding="utf-8") == render(), "run `make helm-schema`"
    assert main(["--check"]) == 0


@pytest.mark.parametrize("name", ["values.yaml", "ci/gpu-autoscaling-values.yaml"])
def test_values_files_validate(name: str) -> None:
    values = _values()
    if name != "values.yaml":  # an overlay: merged over the defaults, as helm does
        values = _merge(values, _values(name))
    _validator().validate(values)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _set(values: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    node = values
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return values


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("engine", "maxNumSeqs"), 0),
        (("engine", "kvCacheMemoryFraction"), 1.5),
        (("engine", "reorderBatch"), "maybe"),
        (("model", "dtype"), "float8"),
        (("logitsProcessors",), ["not a class"]),
        (("workers", "autoscaling", "maxReplicas"), 0),
        (("ports", "http"), 70000),
        (("limits", "max_n"), 0),
        (("engine", "maxNumSeq"), 8),  # a typo: unknown keys fail
    ],
)
def test_schema_rejects_what_the_config_rejects(path: tuple[str, ...], bad: Any) -> None:
    values = _set(_values(), path, bad)
    assert not _validator().is_valid(values)
    if path in VALUES_TO_CONFIG:  # the config model says no to the same value
        nested: Any = bad
        for part in reversed(VALUES_TO_CONFIG[path]):
            nested = {part: nested}
        with pytest.raises(ValueError):
            LogitpoolConfig.model_validate(nested)


def test_every_engine_field_reaches_the_chart_except_device() -> None:
    mapped = {cfg[1] for cfg in VALUES_TO_CONFIG.values() if cfg[0] == "engine"}
    assert mapped == {f.name for f in dataclasses.fields(EngineConfig)} - {"device"}
    props = generate()["properties"]
    assert {"reorderBatch", "loadEntryPoints"} <= set(props["engine"]["properties"])

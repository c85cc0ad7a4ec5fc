"""The Helm values schema is generated from the config model: checked-in equals generated, the
chart's values files validate against it, and it enforces the model's bounds (no Ray, no helm)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jsonschema
import pytest
import yaml

from cluster.config import AutoscalingConfig, LogitpoolConfig
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


# Chart values that deliberately differ from the config's default: a count where the config's
# null means one replica, and the chart's worker pods own a GPU (the config's default runs on CPU).
# workers.cpus: the config leaves it None (1 on a cluster, more under a local `logitpool serve`); a chart is a cluster.
_CHART_OWN_DEFAULTS = {("workers", "replicas"): 1, ("workers", "gpus"): 1, ("workers", "cpus"): 1}


def test_values_yaml_states_the_config_s_own_defaults() -> None:
    """values.yaml restates each default for Helm's sake; the config model is where it lives."""
    defaults = LogitpoolConfig().model_dump(mode="json")
    defaults["workers"]["autoscaling"] = AutoscalingConfig().model_dump(mode="json")  # off by default, same values
    values = _values()
    for chart_path, config_path in VALUES_TO_CONFIG.items():
        if chart_path[0] == "limits" and chart_path[1] not in values.get("limits", {}):
            continue  # an optional section: a key left out takes the config's default
        chart, config = values, defaults
        for part in chart_path:
            chart = chart[part]
        for part in config_path:
            config = config[part]
        expected = _CHART_OWN_DEFAULTS.get(chart_path, config)
        assert chart == expected, f"values.yaml {'.'.join(chart_path)}: {chart!r}, the config's default is {config!r}"

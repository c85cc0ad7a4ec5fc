"""Generate the Helm chart's `values.schema.json` from the pydantic config model.

    python -m cluster.deploy.helm_schema            # rewrite helm/logitpool/values.schema.json
    python -m cluster.deploy.helm_schema --check    # exit 1 when the checked-in file is stale

Every chart value that becomes a `LogitpoolConfig` field (`VALUES_TO_CONFIG`; the template
`logitpool.serveConfig` makes the same mapping) takes its type, bounds and enums from the model,
so the chart cannot drift from the config. The Kubernetes-only keys (image, pods, services,
secrets) have no config field: they are written by hand in `values.schema.k8s.json` beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from cluster.config import ENGINE_FIELDS, ENGINE_JSON_SCHEMA, AutoscalingConfig, LogitpoolConfig
from cluster.limits import Limits
from cluster.routing.config import RoutingConfig

CHART = Path(__file__).resolve().parents[2] / "helm" / "logitpool"
SCHEMA = CHART / "values.schema.json"
K8S_SCHEMA = CHART / "values.schema.k8s.json"

# Engine fields the chart places elsewhere (`model.*`, `logitsProcessors`) or fixes (`device`:
# the template renders null, a worker pod's GPUs decide).
_ENGINE_ELSEWHERE = {"model", "dtype", "max_model_len", "logits_processors", "device"}
# Chart values that must be set although the config field may be null (the chart needs a count).
_NOT_NULL = {("workers", "replicas")}
# Integers in the chart where the config takes a float (a pod's GPU limit is a whole number).
_INTEGER = {("workers", "gpus")}
# Sections whose keys may be left out (the config's defaults apply).
_OPTIONAL = {("limits",), ("routing",)}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _mapping() -> dict[tuple[str, ...], tuple[str, ...]]:
    """Chart value path -> LogitpoolConfig field path."""
    m: dict[tuple[str, ...], tuple[str, ...]] = {
        ("model", "name"): ("engine", "model"),
        ("model", "dtype"): ("engine", "dtype"),
        ("model", "maxModelLen"): ("engine", "max_model_len"),
        ("logitsProcessors",): ("engine", "logits_processors"),
        ("workers", "replicas"): ("workers", "num_replicas"),
        ("workers", "gpus"): ("workers", "num_gpus"),
        ("workers", "cpus"): ("workers", "num_cpus"),
        ("ingress", "replicas"): ("ingress", "num_replicas"),
        ("ingress", "cpus"): ("ingress", "num_cpus"),
        ("ports", "http"): ("server", "http_port"),
        ("ports", "grpc"): ("server", "grpc_port"),
        ("metrics", "names"): ("metrics", "names"),
        ("tools", "callParser"): ("tool_call_parser",),
        ("tools", "callConstrained"): ("tool_call_constrained",),
    }
    for f in ENGINE_FIELDS:
        if f not in _ENGINE_ELSEWHERE:
            m[("engine", _camel(f))] = ("engine", f)
    for f in ("max_ongoing_requests", "max_queued_requests", "stream_interval_s"):
        m[("workers", _camel(f))] = ("workers", f)
    for f in ("max_ongoing_requests", "max_queued_requests"):
        m[("ingress", _camel(f))] = ("ingress", f)
    for f in AutoscalingConfig.model_fields:
        m[("workers", "autoscaling", _camel(f))] = ("workers", "autoscaling", f)
    for f in Limits.model_fields:
        m[("limits", f)] = ("limits", f)
    for f in RoutingConfig.model_fields:
        m[("routing", f)] = ("routing", f)
    return m


VALUES_TO_CONFIG = _mapping()


class _Schema(GenerateJsonSchema):
    """Pydantic's JSON schema; a class object (allowed in-process in `logits_processors`, never in
    a file) has none, so it is left out."""

    def is_instance_schema(self, schema: core_schema.IsInstanceSchema) -> JsonSchemaValue:
        return {"not": {}}


def _config_schema() -> dict[str, Any]:
    return LogitpoolConfig.model_json_schema(schema_generator=_Schema)


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    return _resolve(defs[ref.rsplit("/", 1)[-1]], defs) if ref else node


def _field(schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    defs = schema.get("$defs", {})
    node = schema
    for part in path:
        node = _resolve(node, defs)
        node = node["properties"][part]
        if "anyOf" in node:  # an optional section: its object branch
            objects = [_resolve(n, defs) for n in node["anyOf"] if n.get("type") != "null"]
            node = objects[0] if len(objects) == 1 and "properties" in objects[0] else node
    return _draft7(_resolve(node, defs), defs)


def _draft7(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Pydantic's 2020-12 output as the draft-07 Helm validates with: `X | None` becomes a type
    list; titles and defaults (values.yaml states those) are dropped."""
    if "anyOf" in node:
        branches = [_resolve(n, defs) for n in node["anyOf"]]
        rest = [b for b in branches if b.get("type") != "null" and b != {"not": {}}]
        nullable = len(rest) < len(branches) and any(b.get("type") == "null" for b in branches)
        if len(rest) == 1:
            out = _draft7(rest[0], defs)
            if nullable:
                out["type"] = [out["type"], "null"]
                if "enum" in out:
                    out["enum"] = [*out["enum"], None]
            return out
    out = {k: v for k, v in node.items() if k not in ("title", "default", "description")}
    if "items" in out:
        out["items"] = _draft7(_resolve(out["items"], defs), defs)
    if out.get("exclusiveMinimum") == 0 and out.get("type") == "integer":
        del out["exclusiveMinimum"]
        out["minimum"] = 1
    return out


def generate() -> dict[str, Any]:
    """The chart's values schema: the Kubernetes-only part plus every config-backed value."""
    values = json.loads(K8S_SCHEMA.read_text(encoding="utf-8"))
    values.pop("description", None)
    config = _config_schema()
    computed: set[tuple[str, ...]] = set()
    for chart_path, config_path in VALUES_TO_CONFIG.items():
        node = values
        for i, part in enumerate(chart_path[:-1]):
            props = node.setdefault("properties", {})
            if part not in props:
                props[part] = {"type": "object", "additionalProperties": False, "properties": {}}
            node = props[part]
            if "required" not in node:  # a section of the chart's own: keeps its list
                computed.add(chart_path[: i + 1])
        field = _field(config, config_path)
        if config_path[0] == "engine":
            field.update(copy.deepcopy(ENGINE_JSON_SCHEMA.get(config_path[1], {})))
        if chart_path in _NOT_NULL and isinstance(field.get("type"), list):
            field["type"] = next(t for t in field["type"] if t != "null")
        if chart_path in _INTEGER:
            field["type"] = "integer"
        node.setdefault("properties", {})[chart_path[-1]] = field
    for section in sorted(computed):
        node = values
        for part in section:
            node = node["properties"][part]
        nullable = {k for k, v in node["properties"].items() if isinstance(v.get("type"), list) and "null" in v["type"]}
        node["required"] = [] if section in _OPTIONAL else sorted(set(node["properties"]) - nullable)
    return values


def render() -> str:
    return json.dumps(generate(), indent=2) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cluster.deploy.helm_schema",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--check", action="store_true", help="only compare with the checked-in schema")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if SCHEMA.read_text(encoding="utf-8") != text:
            print(f"{SCHEMA} is stale: run `make helm-schema`", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

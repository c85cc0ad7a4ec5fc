"""OpenAI / vLLM structured-output request fields -> ``StructuredOutputsParams``, and tool calls.

One constraint per request, from exactly one of: OpenAI ``response_format`` (``json_object`` or
``json_schema``), vLLM's ``structured_outputs`` object, the older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar``, or (chat) the tools' constraint
(cluster.openai.tools, which uses the tool schemas built here). What the server does not
implement is a ValueError naming the field (HTTP 400), never silently ignored (the fields in
cluster.openai.unimplemented).
"""

from __future__ import annotations

from typing import Any

from worker.structured_outputs import StructuredOutputsParams

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise ValueError("response_format.json_schema: must be an object with a `schema` object")
        unknown = sorted(set(js) - _JSON_SCHEMA_KEYS)
        if unknown:
            raise ValueError(f"response_format.json_schema: {', '.join(unknown)} not supported")
        return StructuredOutputsParams(json=js["schema"], source="response_format.json_schema.schema")
    raise ValueError(f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def structured_from_fields(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None, guided: dict[str, Any]
) -> StructuredOutputsParams | None:
    """The one constraint the request fields ask for (or None); ValueError if several or invalid."""
    found: list[tuple[str, StructuredOutputsParams | None]] = []
    if response_format is not None:
        found.append(("response_format", from_response_format(response_format)))
    if structured_outputs is not None:
        found.append(("structured_outputs", StructuredOutputsParams.from_dict(structured_outputs)))
    for name in GUIDED:
        if guided.get(name) is not None:
            kind = name.removeprefix("guided_")
            found.append((name, StructuredOutputsParams.from_dict({kind: guided[name]}, name=name)))
    found = [(n, so) for n, so in found if so is not None]
    if len(found) > 1:
        raise ValueError(f"{found[1][0]}: give only one output constraint, got {', '.join(n for n, _ in found)}")
    return found[0][1] if found else None


# -- tools -------------------------------------------------------------------------------------


def tool_functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}]: must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name: must be a non-empty string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
        out[name] = params
    return out


def any_call_schema(fns: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One schema for ``{"name": ..., "arguments": ...}`` of any of the tools. A tool whose
    parameters hold local references (``$ref: "#/$defs/X"``, relative to its own schema) is
    moved under the combined schema's ``$defs`` with its references rebased there, so they
    resolve as they did alone; recursion stays a reference (nothing is expanded)."""
    defs: dict[str, Any] = {}
    calls = []
    for i, (name, params) in enumerate(fns.items()):
        arguments = params
        if _has_ref(params):
            key = f"tool_{i}"
            defs[key] = _rebased(params, params, f"#/$defs/{key}", f"tools[{i}].function.parameters")
            arguments = {"$ref": f"#/$defs/{key}"}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return {"anyOf": calls, **({"$defs": defs} if defs else {})}


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return any(k == "$ref" or (k not in _DATA_KEYWORDS and _has_ref(v)) for k, v in node.items())
    return isinstance(node, list) and any(_has_ref(v) for v in node)


def _rebased(node: Any, root: dict[str, Any], base: str, where: str) -> Any:
    """``node`` (part of ``root``) with every local ``$ref`` checked and prefixed by ``base``."""
    if isinstance(node, list):
        return [_rebased(v, root, base, where) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k == "$ref" and isinstance(v, str):
            _resolve(root, v, where)
            out[k] = base + v[1:]
        elif k in _DATA_KEYWORDS:
            out[k] = v
        else:
            out[k] = _rebased(v, root, base, where)
    return out


def _resolve(root: dict[str, Any], ref: str, where: str) -> None:
    """ValueError naming ``where`` unless ``ref`` is a JSON pointer into ``root`` that reaches a
    schema, not only a chain of references back to itself (which no output could satisfy)."""
    seen: set[str] = set()
    while True:
        if ref != "#" and not ref.startswith("#/"):
            raise ValueError(f"{where}: $ref {ref[:100]!r}: only local references (#/...) are supported")
        if ref in seen:
            raise ValueError(f"{where}: $ref {ref[:100]!r} is a cycle of references with no schema")
        seen.add(ref)
        target: Any = root
        for part in ref[2:].split("/") if ref != "#" else ():
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and key in target:
                target = target[key]
            elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
                target = target[int(key)]
            else:
                raise ValueError(f"{where}: $ref {ref[:100]!r} does not resolve within the tool's parameters")
        if not (isinstance(target, dict) and isinstance(target.get("$ref"), str) and len(target) == 1):
            return
        ref = target["$ref"]

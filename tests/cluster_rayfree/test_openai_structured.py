"""HTTP structured-output fields -> StructuredOutputsParams, tool calls, and what is refused (no Ray)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from cluster.openai.protocol import ChatCompletionRequest, CompletionRequest, chat_response
from worker.outputs import CompletionOutput, RequestOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MSG = [{"role": "user", "content": "hi"}]
TOOLS = [
    {"type": "function", "function": {"name": "get", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "put", "parameters": {"type": "object", "properties": {}}}},
]


def _so(body: dict, chat: bool = True):
    model = ChatCompletionRequest if chat else CompletionRequest
    base = {"messages": MSG} if chat else {"prompt": "p"}
    return model.model_validate({**base, **body}).sampling_params().structured_outputs


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize(
    ("body", "kind", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            "json",
            SCHEMA,
        ),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"]),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"guided_json": SCHEMA}, "json", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
        ({"guided_regex": "b+"}, "regex", "b+"),
        ({"guided_choice": ["p", "q"]}, "choice", ["p", "q"]),
        ({"guided_grammar": 'start: "a"'}, "grammar", 'start: "a"'),
    ],
)
def test_every_spelling_maps_to_one_constraint(chat: bool, body: dict, kind: str, value: object) -> None:
    so = _so(body, chat)
    assert so is not None and so.kind == kind and getattr(so, kind) == value


def test_text_response_format_is_no_constraint() -> None:
    assert _so({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "only one output constraint"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern not supported"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend: not implemented"),
        ({"functions": [{"name": "f"}]}, "functions: not implemented"),
        ({"tool_choice": "required"}, "tool_choice: requires tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope' is not one"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, r"tools\[0\]"),
    ],
)
def test_refused_with_the_field_named(body: dict, needle: str) -> None:
    with pytest.raises((ValueError, ValidationError), match=needle):
        _so(body)


def test_named_tool_constrains_to_its_parameters_and_answers_with_tool_calls() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get"}}}
    )
    assert req.sampling_params().structured_outputs.json == SCHEMA  # type: ignore[union-attr]  # set: the request names a tool
    out = RequestOutput("r", None, [1], [CompletionOutput(0, '{"a": 3}', [5], None, None, finish_reason="stop")], True)
    choice = chat_response("id", "m", out, str, 0, tool=req.tool_calling())["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
    assert call["type"] == "function" and call["function"] == {"name": "get", "arguments": '{"a": 3}'}


def test_required_tool_picks_one_of_the_tools() -> None:
    req = ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS, "tool_choice": "required"})
    so = req.sampling_params().structured_outputs
    assert [b["properties"]["name"]["const"] for b in so.json["anyOf"]] == ["get", "put"]  # type: ignore[union-attr]  # set: tool_choice is "required"
    text = '{"name": "put", "arguments": {}}'
    out = RequestOutput("r", None, [1], [CompletionOutput(0, text, [5], None, None, finish_reason="stop")], True)
    choice = chat_response("id", "m", out, str, 0, tool=req.tool_calling())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "put", "arguments": "{}"}


def test_tool_choice_none_generates_text() -> None:
    assert _so({"tools": TOOLS, "tool_choice": "none"}) is None


# -- tool_choice "required" over tools whose parameters hold local references ------------------

PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
REF_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "locate",
            "parameters": {
                "type": "object",
                "properties": {"place": {"$ref": "#/$defs/Place"}},
                "required": ["place"],
                "$defs": {"Place": PLACE, "Unit": {"enum": ["c", "f"]}},
            },
        },
    },
    {  # the same definition name, another schema: each tool's references stay its own
        "type": "function",
        "function": {
            "name": "tree",
            "parameters": {
                "$ref": "#/$defs/Place",
                "$defs": {
                    "Place": {
                        "type": "object",
                        "properties": {
                            "v": {"type": "integer", "minimum": 0, "maximum": 9},
                            "kids": {"type": "array", "items": {"$ref": "#/$defs/Place"}, "maxItems": 2},
                            "tag": {"const": {"$ref": "#/not/a/reference"}},  # data, not a schema
                        },
                        "required": ["v", "kids"],
                    }
                },
            },
        },
    },
    TOOLS[0],
]


def _required(tools: list[dict]) -> dict:
    body = {"messages": MSG, "tools": tools, "tool_choice": "required"}
    return ChatCompletionRequest.model_validate(body).sampling_params().structured_outputs.json  # type: ignore[union-attr]  # the case sets it


def test_required_keeps_each_tools_references_resolvable() -> None:
    schema = _required(REF_TOOLS)
    valid = [
        {"name": "locate", "arguments": {"place": {"city": "Oslo", "unit": "c"}}},
        {"name": "tree", "arguments": {"v": 1, "kids": [{"v": 2, "kids": []}]}},
        {"name": "get", "arguments": {"a": 3}},
    ]
    invalid = [
        {"name": "locate", "arguments": {"place": {"city": "Oslo", "unit": "k"}}},  # Unit is locate's own
        {"name": "tree", "arguments": {"v": 1, "kids": [{"v": 12, "kids": []}]}},  # recursion checks each level
        {"name": "tree", "arguments": {"city": "Oslo", "unit": "c"}},  # not locate's Place
        {"name": "get", "arguments": {"place": {"city": "Oslo", "unit": "c"}}},
    ]
    for call in valid:
        jsonschema.validate(call, schema)
    for call in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, schema)
    assert schema["anyOf"][2]["properties"]["arguments"] == SCHEMA  # a tool without references stays inline


def test_required_with_references_compiles(tiny_model_dir) -> None:
    """xgrammar said "Cannot find field $defs" before: the references pointed at the combined root."""
    from transformers import AutoTokenizer

    from worker.logits_processor.structured_grammar import compiler_for
    from worker.model.loader import model_limits
    from worker.structured_outputs import StructuredOutputsParams

    vocab_size, _ = model_limits(str(tiny_model_dir), None)
    compiler = compiler_for(AutoTokenizer.from_pretrained(tiny_model_dir), vocab_size)
    assert compiler.compile(StructuredOutputsParams(json=_required(REF_TOOLS))) is not None


@pytest.mark.parametrize(
    ("parameters", "needle"),
    [
        ({"properties": {"a": {"$ref": "#/$defs/Missing"}}}, "does not resolve"),
        ({"properties": {"a": {"$ref": "https://example.com/s.json"}}}, "only local references"),
        ({"properties": {"a": {"$ref": "#anchor"}}}, "only local references"),
        ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, "cycle"),
    ],
)
def test_required_refuses_references_that_cannot_resolve(parameters: dict, needle: str) -> None:
    tools = [TOOLS[1], {"type": "function", "function": {"name": "bad", "parameters": parameters}}]
    with pytest.raises(ValueError, match=rf"^tools\[1\]\.function\.parameters: .*{needle}"):
        _required(tools)

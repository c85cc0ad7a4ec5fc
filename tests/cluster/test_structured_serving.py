"""Structured outputs on a real deployment: the OpenAI SDK's parse() round-trip, tool calls,
vLLM fields, gRPC's oneof, and invalid constraints rejected at the ingress (400 /
INVALID_ARGUMENT naming the field and the compiler's message)."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from client import InvalidArgument
from cluster.config import LogitpoolConfig

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "structured"
MODEL = "tiny"  # the served model name requests must use
MSG = [{"role": "user", "content": "judge this"}]
# Tool choice "auto" reads calls written as `@{"name": ..., "arguments": ...}` (a plug-in loaded by
# class path): a logit bias on "@" makes the random model call a tool.
AT_SIGN_PARSER = "tests.fixtures.tool_parsers:AtSignToolParser"
FORECAST = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
    {
        "type": "function",
        "function": {
            "name": "alarm",
            "parameters": {
                "type": "object",
                "properties": {"at": {"type": "integer", "minimum": 0, "maximum": 23}},
                "required": ["at"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    score: int = Field(ge=0, le=9)
    ok: bool


@pytest.fixture(scope="module")
def serving(serve_ports, tiny_model_dir):
    from ray import serve

    from cluster.cli.launch import wait_ready
    from tests.cluster.serving_helpers import deploy

    cfg = LogitpoolConfig.model_validate(
        {
            "engine": {"model": str(tiny_model_dir), "max_num_seqs": 8, "max_model_len": 1024},
            "workers": {"num_replicas": 1, "num_cpus": 1},
            "server": {"http_port": serve_ports[0], "grpc_port": serve_ports[1]},
            "app_name": APP,
            "served_model_name": MODEL,
            "tool_call_parser": AT_SIGN_PARSER,
        }
    )
    deploy(cfg)
    wait_ready("127.0.0.1", serve_ports[0], timeout_s=180)
    yield cfg
    serve.delete(APP)


def test_sdk_parse_round_trips_a_pydantic_model(oai):
    for seed in range(3):
        r = oai.chat.completions.parse(model=MODEL, messages=MSG, response_format=Verdict, max_tokens=64, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Verdict)


def test_named_tool_call(oai):
    params = {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    }
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": params}}]
    r = oai.chat.completions.create(
        model=MODEL,
        messages=MSG,
        tools=tools,
        max_tokens=64,
        seed=1,
        tool_choice={"type": "function", "function": {"name": "forecast"}},
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "forecast" and r.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), params)


def _streamed(chunks) -> tuple[str, dict[int, dict], str | None, list]:
    """A chat stream reassembled as a client does: content, calls by index, finish_reason, and
    every tool-call delta (to check the first carries id, type and name)."""
    content, calls, finish, deltas = "", {}, None, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        indices = [d.index for d in choice.delta.tool_calls or []]
        assert len(set(indices)) == len(indices), "one entry per call in a chunk, as OpenAI sends"
        for d in choice.delta.tool_calls or []:
            deltas.append(d)
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish, deltas


@pytest.mark.parametrize(
    ("tool_choice", "finish"),
    [({"type": "function", "function": {"name": "forecast"}}, "stop"), ("required", "tool_calls")],
)
def test_streamed_tool_calls_reassemble_to_schema_valid_arguments(oai, tool_choice, finish):
    for seed in range(3):
        chunks = oai.chat.completions.create(
            model=MODEL, messages=MSG, tools=TOOLS, tool_choice=tool_choice, max_tokens=64, seed=seed, stream=True
        )
        content, calls, reason, deltas = _streamed(chunks)
        assert content == "" and reason == finish and list(calls) == [0]
        first = deltas[0]
        assert first.id.startswith("call_") and first.type == "function" and first.function.name == calls[0]["name"]
        assert all(d.id is None and d.function.name is None for d in deltas[1:])
        call = calls[0]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        # the same request whole: the same call (same seed), finish_reason as streamed
        whole = oai.chat.completions.create(
            model=MODEL, messages=MSG, tools=TOOLS, tool_choice=tool_choice, max_tokens=64, seed=seed
        ).choices[0]
        (tc,) = whole.message.tool_calls
        assert whole.finish_reason == finish and tc.function.name == call["name"]
        assert json.loads(tc.function.arguments) == json.loads(call["arguments"])


def _at_token(oai) -> int:
    import httpx

    r = httpx.post(
        str(oai.base_url).removesuffix("/v1/") + "/tokenize", json={"prompt": "@", "add_special_tokens": False}
    )
    (token,) = r.json()["tokens"]
    return token


def _check_text_or_calls(message, reason) -> bool:
    """Either text (no calls) or calls each valid for its tool's schema; True for calls."""
    if not message.tool_calls:
        assert reason in ("stop", "length") and isinstance(message.content, str)
        return False
    assert reason == "tool_calls"
    for tc in message.tool_calls:
        jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
    return True


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_answers_text_or_a_schema_valid_call(oai, stream):
    """tool_choice "auto" (the default with tools), constrained: with the call's opening biased
    the model calls; without, it writes text (or calls); every answer is one or the other."""
    bias = {str(_at_token(oai)): 100}
    called = 0
    for seed in range(4):
        for logit_bias in (bias, None):
            kw = dict(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=96, seed=seed, stop=["}}"])
            # The bias would open call after call: the first call's end ("}}": the arguments' and
            # the call's closing braces, which the flat schemas have nowhere else) stops it, kept
            # in the text the parser reads.
            extra = {"tool_call_constrained": True, "include_stop_str_in_output": True}
            if stream:
                chunks = oai.chat.completions.create(**kw, logit_bias=logit_bias, stream=True, extra_body=extra)
                content, calls, reason, _ = _streamed(chunks)
                message = openai.types.chat.ChatCompletionMessage(
                    role="assistant",
                    content=content or None,
                    tool_calls=[
                        {
                            "id": c["id"],
                            "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]},
                        }
                        for c in calls.values()
                    ]
                    or None,
                )
                if not calls:
                    message.content = content
            else:
                r = oai.chat.completions.create(**kw, logit_bias=logit_bias, extra_body=extra).choices[0]
                message, reason = r.message, r.finish_reason
            called += _check_text_or_calls(message, reason)
    assert called >= 3  # the biased requests call a tool


def test_tool_choice_none_writes_text(oai):
    bias = {str(_at_token(oai)): 100}
    r = oai.chat.completions.create(
        model=MODEL, messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=8, seed=0, logit_bias=bias
    ).choices[0]
    assert r.message.tool_calls is None and r.message.content.startswith("@")


def test_vllm_fields_and_streaming(oai):
    r = oai.completions.create(
        model=MODEL, prompt="p", max_tokens=16, n=3, seed=5, extra_body={"guided_choice": ["red", "green", "blue"]}
    )
    assert {c.text for c in r.choices} <= {"red", "green", "blue"}
    r = oai.completions.create(
        model=MODEL, prompt="p", max_tokens=32, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text)
    chunks = oai.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=64,
        seed=2,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": Verdict.model_json_schema()}},
    )
    Verdict.model_validate_json("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex: invalid regex: .*Unclosed"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format.json_schema.schema: invalid JSON schema: .*objekt",
        ),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar: invalid grammar: .*nothing"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend: not implemented"),
        # issue 17, item 11: impossible or unsatisfiable constraints are 400s too (the second was a 500:
        # the first token found nothing to sample)
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}},
                }
            },
            "response_format.json_schema.schema: invalid JSON schema: minLength 5 is greater than maxLength 2",
        ),
        (
            {"structured_outputs": {"json": {"type": "string", "pattern": "^\\t+$"}}},
            "structured_outputs.json: invalid JSON schema: no output satisfies it",
        ),
        (
            {"structured_outputs": {"regex": "a" * 70_000}},
            r"structured_outputs.regex: 70000 bytes exceeds limits.max_constraint_bytes \(65536\)",
        ),
    ],
)
def test_invalid_constraint_is_a_400_naming_the_field(oai, extra, needle):
    with pytest.raises(openai.BadRequestError, match=needle):
        oai.completions.create(model=MODEL, prompt="p", max_tokens=4, extra_body=extra)


def test_grpc_oneof_and_invalid_argument(grpc_client):
    out = grpc_client.generate("p", max_tokens=16, seed=3, structured_outputs={"choice": ["alpha", "beta"]})
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    out = grpc_client.generate("p", max_tokens=64, seed=3, structured_outputs={"json": Verdict.model_json_schema()})
    Verdict.model_validate_json(out.text)
    with pytest.raises(InvalidArgument, match=r"structured_outputs.json: invalid JSON schema"):
        grpc_client.generate("p", max_tokens=4, structured_outputs={"json": {"type": "objekt"}})
    with pytest.raises(InvalidArgument, match=r"structured_outputs.json: invalid JSON schema: minItems is greater"):
        grpc_client.generate(
            "p", max_tokens=4, structured_outputs={"json": {"type": "array", "minItems": 5, "maxItems": 2}}
        )

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


class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    score: int = Field(ge=0, le=9)
    ok: bool


@pytest.fixture(scope="module")
def serving(serve_ports, tiny_model_dir):
    from ray import serve

    from cluster.cli.launch import deploy, wait_ready

    cfg = LogitpoolConfig.model_validate(
        {
            "engine": {"model": str(tiny_model_dir), "max_num_seqs": 8, "max_model_len": 1024},
            "workers": {"num_replicas": 1, "num_cpus": 1},
            "server": {"http_port": serve_ports[0], "grpc_port": serve_ports[1]},
            "app_name": APP,
            "served_model_name": MODEL,
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
    with pytest.raises(openai.BadRequestError, match="tool_choice: 'auto'"):
        oai.chat.completions.create(model=MODEL, messages=MSG, tools=tools, max_tokens=8)


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

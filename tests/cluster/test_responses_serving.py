"""The Responses API (issue 18, item 9) on a real deployment through the official `openai`
package: ``client.responses.create`` / ``.parse`` / ``.stream`` against the real engine (its
grammar masks for text.format and function tools). Chat's answer for the same request is the
oracle that both run the one front end; tests/cluster_rayfree/test_responses.py has the rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from tests.cluster.serving_helpers import deployed

pytestmark = pytest.mark.ray

APP = "responses"
MODEL = "tiny"
FORECAST = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
ALERT = {"type": "object", "properties": {"level": {"enum": ["low", "high"]}}, "required": ["level"]}
TOOLS: list[Any] = [
    {"type": "function", "name": "forecast", "parameters": FORECAST},
    {"type": "function", "name": "alert", "parameters": ALERT},
]
SCHEMAS = {"forecast": FORECAST, "alert": ALERT}


class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    score: int = Field(ge=0, le=9)
    ok: bool


@pytest.fixture(scope="module")
def serving(serve_ports, tiny_model_dir):
    yield from deployed(
        serve_ports, tiny_model_dir, APP, {"max_num_seqs": 8, "max_model_len": 512}, served_model_name=MODEL
    )


def test_text_is_chats_answer_and_the_limit_makes_it_incomplete(oai: openai.OpenAI, tiny_model_dir: Path) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = oai.responses.create(model=MODEL, instructions="be brief", input="hi there", max_output_tokens=6, temperature=0)
    chat = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)  # type: ignore[arg-type]  # plain dict messages
    assert r.output_text == chat.choices[0].message.content
    expected = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=True
    )
    assert r.usage is not None and r.usage.input_tokens == len(expected["input_ids"]) == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert (r.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    cut = oai.responses.create(model=MODEL, input="hi there", max_output_tokens=1)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert (
        cut.incomplete_details.reason == "max_output_tokens" and cut.usage is not None and cut.usage.output_tokens == 1
    )


def test_json_schema_format_parses_and_streams(oai: openai.OpenAI) -> None:
    parsed = oai.responses.parse(
        model=MODEL, input="judge this", text_format=Verdict, max_output_tokens=64, temperature=0
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Verdict)
    with oai.responses.stream(
        model=MODEL, input="judge this", text_format=Verdict, max_output_tokens=64, temperature=0
    ) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert final.output_parsed == parsed.output_parsed and final.output_text == parsed.output_text
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    # text comes as it is generated, in the worker's stream windows (workers.stream_interval_s)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == final.output_text
    obj = oai.responses.create(
        model=MODEL, input="x", text={"format": {"type": "json_object"}}, max_output_tokens=64, temperature=0
    )
    # a free-form object may run past the limit on the random model: JSON whenever it completes
    assert obj.output_text.startswith("{")
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "alert"}])
def test_function_tool_call_has_schema_valid_arguments(oai: openai.OpenAI, choice: Any) -> None:
    r = oai.responses.create(model=MODEL, input="weather?", tools=TOOLS, tool_choice=choice, max_output_tokens=64)
    (call,) = r.output
    assert call.type == "function_call" and r.status == "completed"
    assert choice == "required" or call.name == "alert"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert call.call_id.startswith("call_")


def test_streamed_tool_call(oai: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "name": "forecast"}
    events = list(
        oai.responses.create(
            model=MODEL, input="weather?", tools=TOOLS, tool_choice=choice, max_output_tokens=64, stream=True
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and events[-1].type == "response.completed"
    jsonschema.validate(json.loads(done[0].arguments), FORECAST)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_calling_loop(oai: openai.OpenAI) -> None:
    """The agent loop: a required call, its output sent back with the call, then a text answer
    whose prompt is chat's for the same conversation (its tool call and tool message)."""
    first = oai.responses.create(
        model=MODEL, input="weather?", tools=TOOLS, tool_choice="required", max_output_tokens=64
    )
    (call,) = first.output
    assert call.type == "function_call" and first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    turns: list[Any] = [{"role": "user", "content": "weather?"}, call.model_dump(exclude_none=True), result]
    second = oai.responses.create(
        model=MODEL, input=turns, tools=TOOLS, tool_choice="none", max_output_tokens=4, temperature=0
    )
    assert [item.type for item in second.output] == ["message"] and second.output_text
    tool_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    msgs: list[Any] = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    chat_tools: list[Any] = [
        {"type": "function", "function": {"name": t["name"], "parameters": t["parameters"]}} for t in TOOLS
    ]
    chat = oai.chat.completions.create(
        model=MODEL, messages=msgs, tools=chat_tools, tool_choice="none", max_tokens=4, temperature=0
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens  # type: ignore[union-attr]


def test_unserved_fields_are_400s_and_nothing_is_stored(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="x", store=True)
    assert err.value.body["param"] == "store"  # type: ignore[index]  # the SDK types body as object
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_0")

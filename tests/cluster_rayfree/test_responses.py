"""The Responses API (issue 18, item 9) without a Ray cluster: the request -> chat mapping and the
event assembly as plain functions, then the route through the official `openai` package over the
fake engine (tests/cluster_rayfree/test_frontend_local.py's fixtures). The token ids the engine
receives are the oracle for the prompt; the SDK's own types and stream helper for the shapes."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from cluster.errors import Status, classify
from cluster.frontend import Frontend
from cluster.openai.protocol import ChatCompletionRequest, chat_choices
from cluster.openai.responses import (
    ResponseEvents,
    ResponseObject,
    ResponsesRequest,
    finished,
    responses_field,
    responses_fields,
)
from cluster.openai.tool_parsers import load_tool_call_parser
from tests.cluster_rayfree.fake_engine import FakeEngine, fake_token
from tests.cluster_rayfree.test_frontend_clients import sdk, seen_prompts, template_ids
from tests.cluster_rayfree.test_frontend_local import KEY, cfg, fe, http, worker  # noqa: F401 - fixtures
from worker.outputs import CompletionOutput, RequestOutput

PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


# -- the mapping onto chat ---------------------------------------------------------------------


def test_request_is_the_chat_request_it_maps_onto() -> None:
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"role": "developer", "content": "answer in JSON"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi "}, {"type": "input_text", "text": "there"}],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
                {"role": "user", "content": "weather?"},
            ],
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "tools": [{"type": "function", "name": "forecast", "parameters": PARAMS, "description": "d"}],
            "tool_choice": {"type": "function", "name": "forecast"},
            "future_field": 1,  # unknown fields are ignored, as on every route
        }
    )
    expected = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "system", "content": "answer in JSON"},
                {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "weather?"},
            ],
            "max_completion_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "tools": [{"type": "function", "function": {"name": "forecast", "parameters": PARAMS, "description": "d"}}],
            "tool_choice": {"type": "function", "function": {"name": "forecast"}},
        }
    )
    chat = req.chat_request()
    assert chat.model_dump() == expected.model_dump()
    assert chat.sampling_params() == expected.sampling_params()
    assert chat.sampling_params().structured_outputs.json == PARAMS  # chat's constraint for the named tool


def test_text_format_is_response_format() -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    flat = {"type": "json_schema", "name": "v", "schema": schema, "strict": True}
    chat = ResponsesRequest.model_validate({"input": "x", "text": {"format": flat}}).chat_request()
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "v", "schema": schema, "strict": True},
    }
    assert chat.sampling_params().structured_outputs.json == schema
    obj = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "json_object"}}}).chat_request()
    assert obj.sampling_params().structured_outputs.json_object
    free = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "text"}}}).chat_request()
    assert free.response_format is None and free.sampling_params().structured_outputs is None
    # tools without tool_choice: chat's default for tools ('auto'), whatever chat makes of it
    auto = ResponsesRequest.model_validate({"input": "x", "tools": [{"type": "function", "name": "f"}]})
    assert auto.chat_request().tool_choice is None and not auto.streams_text


# The agent loop: an earlier answer (text and two calls) sent back with the calls' results.
LOOP_INPUT: list[Any] = [
    {"role": "user", "content": "weather in Oslo and Lima?"},
    {"type": "message", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": "ok"}]},
    {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "forecast", "arguments": '{"city":"Oslo"}'},
    {
        "type": "function_call",
        "call_id": "c2",
        "name": "forecast",
        "arguments": '{"city":"Lima"}',
        "status": "completed",
    },
    {"type": "function_call_output", "call_id": "c1", "output": "rain"},
    {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]},
]
LOOP_MESSAGES: list[Any] = [
    {"role": "user", "content": "weather in Oslo and Lima?"},
    {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "forecast", "arguments": '{"city":"Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "forecast", "arguments": '{"city":"Lima"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    {"role": "tool", "tool_call_id": "c2", "content": "sun"},
]
FORECAST_TOOL: Any = {"type": "function", "name": "forecast", "parameters": PARAMS}


def test_function_call_items_are_chats_tool_messages() -> None:
    req = ResponsesRequest.model_validate({"input": LOOP_INPUT, "tools": [FORECAST_TOOL], "tool_choice": "none"})
    expected = ChatCompletionRequest.model_validate(
        {
            "messages": LOOP_MESSAGES,
            "tools": [{"type": "function", "function": {"name": "forecast", "parameters": PARAMS}}],
            "tool_choice": "none",
        }
    )
    assert req.chat_messages() == LOOP_MESSAGES
    assert req.chat_request().model_dump() == expected.model_dump()
    # calls with no text before them are an assistant message of their own
    bare = ResponsesRequest.model_validate({"input": [LOOP_INPUT[0], *LOOP_INPUT[2:]]})
    assert bare.chat_messages() == [LOOP_MESSAGES[0], {**LOOP_MESSAGES[1], "content": None}, *LOOP_MESSAGES[2:]]


def test_agent_loop_prompt_is_chats_prompt(fe: Frontend) -> None:  # noqa: F811 - fixture
    tools: list[Any] = [{"type": "function", "function": {"name": "forecast", "parameters": PARAMS}}]
    sdk(fe, lambda c: c.chat.completions.create(model=fe.model_name, messages=LOOP_MESSAGES, tools=tools, max_tokens=1))
    sdk(
        fe,
        lambda c: c.responses.create(
            model=fe.model_name, input=LOOP_INPUT, tools=[FORECAST_TOOL], tool_choice="none", max_output_tokens=1
        ),
    )
    chat_prompt, responses_prompt = seen_prompts()
    assert responses_prompt == chat_prompt
    # the calls are in the prompt, in the tool-call parser's format, and so are their results
    text = fe.tokenizer.decode(responses_prompt)
    assert load_tool_call_parser(fe.cfg.tool_call_parser).render_call("forecast", '{"city":"Lima"}') in text
    assert "rain" in text and "sun" in text


@pytest.mark.parametrize(
    ("chat", "ours"),
    [
        ("messages: must not be empty", "input: must not be empty"),
        ("max_completion_tokens: must be an integer >= 1, got 0", "max_output_tokens: must be an integer >= 1, got 0"),
        (
            "max_tokens: This model's maximum context length is 8",
            "max_output_tokens: This model's maximum context length is 8",
        ),
        ("response_format.json_schema.schema: invalid JSON schema: x", "text.format.schema: invalid JSON schema: x"),
        ("tools[2].function.name: must be a non-empty string", "tools[2].name: must be a non-empty string"),
        ("tools[f].function.parameters: invalid JSON schema", "tools[f].parameters: invalid JSON schema"),
        ("tool_choice.function.name: 'g' is not one of the tools", "tool_choice.name: 'g' is not one of the tools"),
        ("temperature: must be >= 0", "temperature: must be >= 0"),
        ("no field named here", "no field named here"),
    ],
)
def test_chat_errors_name_the_responses_field(chat: str, ours: str) -> None:
    assert responses_field(chat) == ours
    with pytest.raises(ValueError) as err, responses_fields():
        raise ValueError(chat)
    assert str(err.value) == ours


# -- the output and the event sequence ---------------------------------------------------------


def _out(text: str, reason: str, n_prompt: int = 4) -> RequestOutput:
    tokens = list(range(len(text)))
    return RequestOutput(
        "r", None, list(range(n_prompt)), [CompletionOutput(0, text, tokens, None, None, reason)], True, None, 2
    )


def _answer(req: ResponsesRequest, out: RequestOutput) -> ResponseObject:
    chat = req.chat_request()
    head = ResponseObject.start("m", req)
    return finished(head, next(chat_choices(out, str, 0, tool=chat.tool_calling())), out)


def test_finished_response_from_chats_answer() -> None:
    text = ResponsesRequest.model_validate({"input": "x", "max_output_tokens": 9})
    done = _answer(text, _out("hello", "stop"))
    assert (done.status, done.incomplete_details, done.output[0].status) == ("completed", None, "completed")
    assert done.usage is not None and done.usage.model_dump() == {
        "input_tokens": 4,
        "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 9,
    }
    cut = _answer(text, _out("hel", "length"))
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.output[0].status == "incomplete"

    tools = [{"type": "function", "name": "forecast", "parameters": PARAMS}]
    required = ResponsesRequest.model_validate({"input": "x", "tools": tools, "tool_choice": "required"})
    args = {"city": "Oslo", "days": 2}
    call = _answer(required, _out(json.dumps({"name": "forecast", "arguments": args}), "stop")).output
    assert len(call) == 1 and call[0].type == "function_call"
    assert (call[0].name, json.loads(call[0].arguments), call[0].status) == ("forecast", args, "completed")
    assert call[0].call_id.startswith("call_")
    sdk_response = openai.types.responses.Response.model_validate(done.model_dump(mode="json"))
    assert sdk_response.output_text == "hello"


def _validated(events: list[Any]) -> list[Any]:
    """The events as the SDK's own types (each must validate as its `type` says), numbered 0.."""
    typed = [STREAM_EVENT.validate_python(e.model_dump(mode="json")) for e in events]
    assert [e.sequence_number for e in typed] == list(range(len(typed)))
    return typed


def test_text_events_are_openais_sequence() -> None:
    req = ResponsesRequest.model_validate({"input": "x"})
    head = ResponseObject.start("m", req)
    stream = ResponseEvents(head)
    events = stream.start() + stream.open_text()
    for piece in ("hel", "", "lo"):
        events += stream.text(piece)
    final = _answer(req, _out("hello", "stop"))
    typed = _validated(events + stream.finish(final))
    assert [e.type for e in typed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    item_id = typed[2].item.id
    assert {e.item_id for e in typed[3:8]} == {item_id} == {typed[8].item.id, typed[9].response.output[0].id}
    assert "".join(e.delta for e in typed[4:6]) == typed[6].text == typed[9].response.output_text == "hello"
    assert typed[0].response.status == "in_progress" and typed[9].response.usage.output_tokens == 5


def test_tool_call_events_come_whole_at_the_end() -> None:
    tools = [{"type": "function", "name": "forecast", "parameters": PARAMS}]
    req = ResponsesRequest.model_validate(
        {"input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "forecast"}}
    )
    assert not req.streams_text
    stream = ResponseEvents(ResponseObject.start("m", req))
    final = _answer(req, _out('{"city":"Lima","days":3}', "stop"))
    typed = _validated(stream.start() + stream.finish(final))
    assert [e.type for e in typed[2:]] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert typed[2].item.arguments == "" and typed[2].item.status == "in_progress"
    assert typed[3].delta == typed[4].arguments == typed[5].item.arguments == '{"city":"Lima","days":3}'
    assert typed[6].response.output[0].name == "forecast"


def test_failed_stream_ends_with_the_error() -> None:
    stream = ResponseEvents(ResponseObject.start("m", ResponsesRequest.model_validate({"input": "x"})))
    typed = _validated(stream.start() + stream.failed(classify(ValueError("temperature: too hot"))))
    assert [e.type for e in typed[2:]] == ["error", "response.failed"]
    assert (typed[2].param, typed[2].message) == ("temperature", "temperature: too hot")
    assert typed[3].response.status == "failed" and typed[3].response.error.message == "temperature: too hot"
    internal = stream.failed(Status(500, classify(RuntimeError()).grpc, "internal error", "internal_error"))
    assert internal[0].model_dump()["param"] is None


# -- the route, through the SDK, over the fake engine --------------------------------------------


def _expected_text(prompt: list[int], n: int) -> str:
    return "".join(f"<{fake_token(prompt, i)}>" for i in range(n))


def test_create_through_the_sdk(fe: Frontend) -> None:  # noqa: F811 - fixture
    r = sdk(
        fe,
        lambda c: c.responses.create(
            model=fe.model_name, instructions="be brief", input="hi there", max_output_tokens=3
        ),
    )
    (prompt,) = seen_prompts()
    assert prompt == template_ids(
        fe, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == fe.model_name
    assert r.output_text == _expected_text(prompt, 3)
    # the fake engine always stops at max_tokens: cut by the limit
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(prompt), 3, len(prompt) + 3)
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.store) == ("be brief", 3, False)
    ((_, _, params),) = FakeEngine.seen
    assert params.max_tokens == 3
    FakeEngine.cached_tokens = 5  # what the worker says its prefix cache served (fe resets it)
    again = sdk(fe, lambda c: c.responses.create(model=fe.model_name, input="hi there", max_output_tokens=1))
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens == 5


def test_stream_through_the_sdk_helper(fe: Frontend) -> None:  # noqa: F811 - fixture
    async def run(c: openai.AsyncOpenAI) -> list[Any]:
        async with c.responses.stream(model=fe.model_name, input="hi", max_output_tokens=4) as s:
            return [e async for e in s]  # the helper checks each event against what it has seen

    seen = sdk(fe, run)
    final = seen[-1].response  # incomplete: the helper's get_final_response() wants response.completed
    (prompt,) = seen_prompts()
    types = [e.type for e in seen]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert len(deltas) == 4 and "".join(deltas) == final.output_text == _expected_text(prompt, 4)
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert final.status == "incomplete" and final.usage.output_tokens == 4


def test_a_failed_stream_says_so(fe: Frontend, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - fixture
    monkeypatch.setattr(FakeEngine, "mode", "error")

    async def run(c: openai.AsyncOpenAI) -> list[Any]:
        return [e async for e in await c.responses.create(model=fe.model_name, input="hi", stream=True)]

    seen = sdk(fe, run)
    assert [e.type for e in seen][-2:] == ["error", "response.failed"]
    assert "fake processor failed" in seen[-2].message and seen[-1].response.status == "failed"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c"},
                ]
            },
            "input[1].output",
        ),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]},
                ]
            },
            "input[1].output[0].type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "store": True}, "store"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0].name"),
        (
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice.name",
        ),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}},
            "tool_choice.type",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "v"}}}, "text.format.schema"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "v", "schema": {"type": "objekt"}}}},
            "text.format.schema",
        ),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "x", "text": {"verbosity": "high"}}, "text.verbosity"),
        (
            {"input": "x", "stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
        ({"input": "x", "stream_options": {}}, "stream_options"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "x", "temperature": -1}, "temperature"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(fe: Frontend, body: dict, param: str) -> None:  # noqa: F811 - fixture
    r = http(fe, "POST", "/v1/responses", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert FakeEngine.seen == []


def test_off_values_model_key_and_nothing_stored(fe: Frontend) -> None:  # noqa: F811 - fixture
    off = {"store": False, "background": False, "include": [], "truncation": "disabled", "top_logprobs": 0}
    r = http(fe, "POST", "/v1/responses", {"input": "x", "max_output_tokens": 1, **off})
    assert r.status_code == 200, r.text
    assert http(fe, "POST", "/v1/responses", {"input": "x", "model": "gpt-4"}).json()["error"]["param"] == "model"
    assert http(fe, "POST", "/v1/responses", {"input": "x"}, key=None).status_code == 401
    with pytest.raises(openai.NotFoundError) as err:
        sdk(fe, lambda c: c.responses.retrieve("resp_abc"))
    assert err.value.body["param"] == "response_id" and "stores no responses" in err.value.body["message"]
    assert http(fe, "DELETE", "/v1/responses/resp_abc").status_code == 404
    assert http(fe, "POST", "/v1/responses/resp_abc/cancel").json()["error"]["param"] == "response_id"
    assert http(fe, "GET", "/v1/responses/resp_abc", key=None).status_code == 401
    doc = http(fe, "GET", "/openapi.json").json()
    op = doc["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert "text/event-stream" in op["responses"]["200"]["content"]

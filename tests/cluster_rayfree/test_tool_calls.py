"""Tool calls without Ray: the tool-call parsers against a plain reference (the text each format
writes for known calls), streaming against the whole parse at every split, tool_choice's
constraints (the auto grammar run through xgrammar's matcher) and the parser plug-in loader."""

from __future__ import annotations

import json

import pytest
import xgrammar
from hypothesis import given, settings
from hypothesis import strategies as st
from xgrammar.testing import _is_grammar_accept_string

from cluster.config import LogitpoolConfig
from cluster.openai.protocol import ChatCompletionRequest, ToolDelta, chat_chunk
from cluster.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    HermesToolParser,
    ParsedOutput,
    ToolCallParser,
    load_tool_call_parser,
)
from cluster.openai.tools import ToolCalling, tool_calling
from worker.outputs import CompletionOutput

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
MSG = [{"role": "user", "content": "hi"}]

# -- a plain reference: how each format writes known calls --------------------------------------


def _hermes(content: str, calls: list[tuple[str, str]]) -> str:
    body = "".join(f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n</tool_call>\n' for n, a in calls)
    return content + body


def _llama(content: str, calls: list[tuple[str, str]]) -> str:
    return content + "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)


def _mistral(content: str, calls: list[tuple[str, str]]) -> str:
    return (
        content + "[TOOL_CALLS][" + ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {a}}}' for n, a in calls) + "]"
    )


def _mistral_v11(content: str, calls: list[tuple[str, str]]) -> str:
    return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)


FORMATS = {"hermes": _hermes, "llama3_json": _llama, "mistral": _mistral, "mistral_v11": _mistral_v11}

json_leaf = st.one_of(st.integers(-1000, 1000), st.text(max_size=8), st.booleans(), st.none())
arguments = st.dictionaries(
    st.text(min_size=1, max_size=6),
    st.recursive(json_leaf, lambda c: st.lists(c, max_size=3), max_leaves=4),
    max_size=3,
).map(json.dumps)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)
# Content that none of the formats would read as a call's opening.
contents = st.text(alphabet=st.characters(blacklist_characters="<[{"), max_size=20)


@settings(max_examples=150, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)), content=contents, calls=st.lists(st.tuples(names, arguments), max_size=3))
def test_parsers_read_what_their_format_writes(fmt: str, content: str, calls: list[tuple[str, str]]) -> None:
    parser = load_tool_call_parser(fmt.removesuffix("_v11"))
    text = FORMATS[fmt](content, calls)
    parsed = parser.parse(text, final=True)
    if not calls:  # mistral's marker with an empty list is not a call either
        assert parsed.content == text and not parsed.calls
        return
    assert not parsed.malformed
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [(n, json.loads(a)) for n, a in calls]


@settings(max_examples=150, deadline=None)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    content=contents,
    calls=st.lists(st.tuples(names, arguments), max_size=3),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_streamed_deltas_add_up_to_the_whole_parse(
    fmt: str, content: str, calls: list[tuple[str, str]], cuts: list[int]
) -> None:
    """Fed in arbitrary pieces, a stream's content and per-call deltas add up to what the whole
    output parses to: names first and whole, each call's id and name once, arguments in order."""
    parser = load_tool_call_parser(fmt.removesuffix("_v11"))
    text = FORMATS[fmt](content, calls)
    shown, names_seen, args = _reassembled(ToolCalling(parser, None), text, cuts)
    expected = parser.parse(text, final=True)
    assert shown == expected.content
    assert [names_seen[i] for i in sorted(names_seen)] == [c.name for c in expected.calls]
    assert [args[i] for i in sorted(args)] == [c.arguments for c in expected.calls]


def _reassembled(calling: ToolCalling, text: str, cuts: list[int]) -> tuple[str, dict[int, str | None], dict[int, str]]:
    """``text`` streamed in pieces cut at ``cuts``, put back together as a client does: the
    content, and per call index its name and arguments; checks each delta's shape on the way."""
    stream = calling.stream()
    points = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    shown, names_seen, args = "", {}, {}
    prev = 0
    for p in points:
        piece, deltas = stream.feed(text[prev:p], final=p == len(text))
        prev = p
        shown += piece
        assert len({d["index"] for d in deltas}) == len(deltas), "one entry per call in a chunk, as OpenAI"
        for d in deltas:
            i, fn = d["index"], d["function"]
            if "id" in d:
                assert i not in names_seen and d.get("type") == "function"
                names_seen[i] = fn.get("name")
                args[i] = fn["arguments"]  # the arguments known when the call opens (often "")
            else:
                assert i in names_seen and "name" not in fn and "type" not in d
                args[i] += fn["arguments"]
    return shown, names_seen, args


@settings(max_examples=100, deadline=None)
@given(name=names, args=arguments, named=st.booleans(), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_forced_tool_streams_add_up_to_the_whole_answer(name: str, args: str, named: bool, cuts: list[int]) -> None:
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}]
    choice = {"type": "function", "function": {"name": name}} if named else "required"
    calling = tool_calling(tools, choice, HermesToolParser(), False)
    assert calling is not None
    text = args if named else f'{{"name": {json.dumps(name)}, "arguments": {args}}}'
    shown, names_seen, streamed = _reassembled(calling, text, cuts)
    message, reason = calling.message(text, "stop")
    (call,) = message.get("tool_calls", [])
    assert shown == "" and names_seen == {0: name} and streamed == {0: call["function"]["arguments"]}
    assert json.loads(streamed[0]) == json.loads(args) and reason == ("stop" if named else "tool_calls")


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_text_that_only_looks_like_a_call_is_content(parser: str) -> None:
    p = load_tool_call_parser(parser)
    for text in ("<tool_call>not json", '[TOOL_CALLS][{"name": 3}]', '{"name": "x", "arguments": {'):
        parsed = p.parse(text, final=True)
        assert parsed.content == text and not parsed.calls
    assert ToolCalling(p, None).message("just words <tool", "stop")[0]["content"] == "just words <tool"


def test_a_possible_marker_is_held_back_until_it_is_not_one() -> None:
    stream = ToolCalling(HermesToolParser(), None).stream()
    assert stream.feed("Hello <tool", final=False) == ("Hello ", [])
    assert stream.feed("box> done", final=True) == ("<toolbox> done", [])
    assert not stream.called


def test_auto_message_and_finish_reason() -> None:
    calling = ToolCalling(HermesToolParser(), None)
    text = 'Let me look.<tool_call>\n{"name": "forecast", "arguments": {"city": "Oslo"}}\n</tool_call>'
    message, reason = calling.message(text, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me look."
    (call,) = message.get("tool_calls", [])
    assert call["function"]["name"] == "forecast" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert calling.message("plain answer", "stop")[0] == {"role": "assistant", "content": "plain answer"}
    cut = text[:-30]
    assert calling.message(cut, "length") == (calling.message(cut, "length")[0], "length")
    assert calling.message(cut, "length")[0]["content"] == cut


def test_stream_chunk_shapes_match_openai() -> None:
    calling = tool_calling(TOOLS, {"type": "function", "function": {"name": "forecast"}}, HermesToolParser(), False)
    assert calling is not None and calling.named
    stream = calling.stream()
    content, deltas = stream.feed('{"city": ', final=False)
    c = CompletionOutput(0, '{"city": ', [5], None, None)
    chunk = chat_chunk("id", "m", c, str, 0, True, created=1, tool_delta=ToolDelta(content, deltas, None))
    delta = chunk["choices"][0]["delta"]
    assert delta["role"] == "assistant" and "content" not in delta
    (first,) = delta["tool_calls"]  # one entry per call: the header carries the first arguments
    assert first["function"] == {"name": "forecast", "arguments": '{"city": '} and first["type"] == "function"
    assert first["id"].startswith("call_") and first["index"] == 0
    _, more = stream.feed('"Oslo"}', final=True)
    assert more == [{"index": 0, "function": {"arguments": '"Oslo"}'}}]
    # a named function finishes as generated; required and auto say tool_calls
    assert calling.finish_reason(True, "stop") == "stop"
    required = tool_calling(TOOLS, "required", HermesToolParser(), False)
    assert required is not None and required.finish_reason(True, "stop") == "tool_calls"


def test_auto_is_the_default_with_tools_and_none_is_text() -> None:
    req = ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS})
    auto = req.tool_calling()
    assert auto is not None and auto.constraint is None and isinstance(auto.parser, HermesToolParser)
    params = req.sampling_params(auto)
    assert params.structured_outputs is None and params.skip_special_tokens is True  # hermes' tags are not special
    mistral = req.tool_calling(load_tool_call_parser("mistral"))
    assert req.sampling_params(mistral).skip_special_tokens is False  # [TOOL_CALLS] is a control token
    assert (
        ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS, "tool_choice": "none"}).tool_calling()
        is None
    )
    streamed = ChatCompletionRequest.model_validate(
        {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "stream": True}
    )
    assert streamed.sampling_params().structured_outputs is not None  # streaming tool calls are allowed


def _accepts(grammar: str, text: str) -> bool:
    return bool(_is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar), text))


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_constrained_auto_allows_text_or_a_schema_valid_call(parser: str) -> None:
    p = load_tool_call_parser(parser)
    body = {"messages": MSG, "tools": TOOLS, "tool_call_constrained": True}
    calling = ChatCompletionRequest.model_validate(body).tool_calling(p)
    assert calling is not None and calling.constraint is not None and calling.constraint.grammar is not None
    grammar = calling.constraint.grammar
    fmt = p.call_format
    assert fmt is not None
    good = fmt.begin.format(name="forecast") + '{"city": "Oslo", "days": 3}' + fmt.end
    bad_args = fmt.begin.format(name="forecast") + '{"days": 3}' + fmt.end  # `city` is required
    bad_name = fmt.begin.format(name="weather") + '{"city": "Oslo"}' + fmt.end
    assert _accepts(grammar, "Just text, no call.")
    assert _accepts(grammar, "Sure. " + good)
    assert not _accepts(grammar, "Sure. " + bad_args)
    assert not _accepts(grammar, bad_name)
    parsed = p.parse("Sure. " + good, final=True)
    assert [c.name for c in parsed.calls] == ["forecast"]


def test_constrained_auto_cannot_be_combined_with_another_constraint() -> None:
    body = {"messages": MSG, "tools": TOOLS, "tool_call_constrained": True, "guided_regex": "a+"}
    with pytest.raises(ValueError, match="tool_choice: cannot be combined"):
        ChatCompletionRequest.model_validate(body).sampling_params()


class _Reversed(ToolCallParser):
    """A plug-in format for the loader test: no calls, content reversed."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput(text[::-1])


def test_parsers_load_by_name_or_class_path() -> None:
    assert isinstance(load_tool_call_parser(f"{__name__}:_Reversed"), _Reversed)
    for bad, needle in [
        ("nope", "not one of hermes"),
        ("json:loads", "not a concrete ToolCallParser"),
        ("no_such_module:X", "could not be loaded"),
    ]:
        with pytest.raises(ValueError, match=f"tool_call_parser: .*{needle}"):
            load_tool_call_parser(bad)
    assert LogitpoolConfig.model_validate({"tool_call_parser": "mistral"}).tool_call_parser == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        LogitpoolConfig.model_validate({"tool_call_parser": "nope"})
    with pytest.raises(ValueError, match="does not say how a call is written"):
        tool_calling(TOOLS, "auto", _Reversed(), True)


def test_the_config_default_is_the_registry_default() -> None:
    from cluster.openai.tool_parsers import DEFAULT_TOOL_CALL_PARSER

    assert LogitpoolConfig().tool_call_parser == DEFAULT_TOOL_CALL_PARSER


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = _hermes("", [("forecast", '{"city": "Oslo"}'), ("noop", "{}")])
    both = ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS}).tool_calling()
    one = ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS, "parallel_tool_calls": False})
    first = one.tool_calling()
    assert both is not None and first is not None
    assert len(both.message(text, "stop")[0].get("tool_calls", [])) == 2
    (call,) = first.message(text, "stop")[0].get("tool_calls", [])
    assert call["function"]["name"] == "forecast"
    _, deltas = first.stream().feed(text, final=True)
    assert {d["index"] for d in deltas} == {0}
    constrained = one.model_copy(update={"tool_call_constrained": True}).tool_calling()
    assert constrained is not None and constrained.constraint is not None
    grammar = constrained.constraint.grammar or ""
    call_text = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert _accepts(grammar, "ok " + call_text) and not _accepts(grammar, "ok " + call_text + " more")


@pytest.mark.parametrize("parser", sorted(TOOL_CALL_PARSERS))
def test_an_earlier_turns_calls_go_back_into_the_prompt_as_the_model_writes_them(parser: str) -> None:
    """An agent's history: the assistant's calls (content null) come back as the text the parser
    reads as those calls, so the model sees what it called."""
    p = load_tool_call_parser(parser)
    call = {"type": "function", "id": "call_1", "function": {"name": "forecast", "arguments": '{"city": "Oslo"}'}}
    body = {
        "messages": [
            *MSG,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny"},
        ],
        "tools": TOOLS,
    }
    req = ChatCompletionRequest.model_validate(body)
    turns = [m.turn(p) for m in req.messages]
    assert turns[0] == ("user", "hi") and turns[2] == ("tool", "sunny")
    role, text = turns[1]
    parsed = p.parse(text, final=True)
    assert role == "assistant" and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("forecast", {"city": "Oslo"})
    ]
    with pytest.raises(ValueError, match=r"messages: tool_calls: .* cannot write a call"):
        req.messages[1].turn(_Reversed())

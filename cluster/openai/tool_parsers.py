"""Tool-call parsers: how a model writes a tool call in its text, as a plug-in (vLLM's
``--tool-call-parser`` idea).

A parser is pure: ``parse(text, final)`` reads the whole output so far and says which part is
plain content that can be shown now and which tool calls have begun (name once it is whole,
arguments as far as generated). Streaming re-parses the growing text and sends what is new
(cluster.openai.tools.ToolCallStream), so a parser holds no state and the same one serves
non-streaming, streaming and every choice. Content is the text before the first call (vLLM's).

Built in, by name (``tool_call_parser`` in the config): ``hermes`` (``<tool_call>{json}</tool_call>``,
Qwen 2.5/3, Hermes), ``llama3_json`` (a JSON object, optionally after ``<|python_tag|>``, several
separated by ``;``) and ``mistral`` (``[TOOL_CALLS]`` then a JSON array, or v11's
``[TOOL_CALLS]name[ARGS]{json}``). Any other: ``dotted.module:ClassName`` of a ``ToolCallParser``
subclass (loaded like logits processors). A parser that can also say what a call looks like
(``call_format``) serves constrained auto tool choice (cluster.openai.tools.constrained_auto).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

# Where a JSON member's value starts and ends in the text (end None: not generated to its end yet).
Span = tuple[int, int | None]


@dataclass(frozen=True)
class ParsedCall:
    """One tool call as far as generated: ``name`` once its string is whole, ``arguments`` the
    JSON text of its arguments so far (a prefix of the final text), ``complete`` once its end is in."""

    name: str | None
    arguments: str
    complete: bool


@dataclass(frozen=True)
class ParsedOutput:
    """``content``: text outside calls that can be shown now (a suffix that may still become a
    call's opening is held back until ``final``); ``malformed``: a call was opened but the text is
    not a call after all, so the whole output is content."""

    content: str
    calls: tuple[ParsedCall, ...] = ()
    malformed: bool = False


@dataclass(frozen=True)
class CallFormat:
    """How one call is written, for a grammar: ``begin`` (``{name}`` is replaced by the
    function's name) + the arguments as JSON + ``end``; ``trigger``: the text that opens a call."""

    trigger: str
    begin: str
    end: str


class ToolCallParser(ABC):
    """A tool-call format (see the module docstring). ``needs_special_tokens``: its markers are
    special tokens in the models that use it, so they must stay in the text (the request's
    ``skip_special_tokens`` defaults to false when this parser reads it; the engine then also
    keeps the end-of-sequence token's text at the end of a text answer, which vLLM drops)."""

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False
    call_format: ClassVar[CallFormat | None] = None

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The content and calls in ``text``; ``final``: no more text will come."""

    def render_call(self, name: str, arguments: str) -> str:
        """One call as the model writes it (an earlier turn's call, back in the prompt)."""
        if self.call_format is None:
            raise ValueError(
                f"messages: tool_calls: the tool-call parser {self.name or type(self).__name__!r} "
                "cannot write a call back into the prompt (it has no call_format)"
            )
        return self.call_format.begin.format(name=name) + arguments + self.call_format.end


# -- reading JSON as it is generated -----------------------------------------------------------

_WS = " \t\r\n"
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")


class _Malformed(ValueError):
    """The text cannot be (the start of) what the format expects."""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """The index after the JSON string starting at text[i] ('"'), None if not closed yet."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _value_end(text: str, i: int, final: bool) -> int | None:
    """The index after the JSON value starting at text[i], None while it is not all generated."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(text, i)
    if m is None:
        raise _Malformed(text[i : i + 20])
    # A number at the end of the text may go on.
    return m.end() if (m.end() < len(text) or final) else None


def object_members(text: str, i: int, final: bool) -> tuple[dict[str, Span], int | None]:
    """The top-level members of the JSON object starting at text[i] (after whitespace): key ->
    value span, and the index after its closing brace (None while open). _Malformed if the text
    cannot be the start of an object."""
    i = _skip_ws(text, i)
    members: dict[str, Span] = {}
    if i >= len(text):
        return members, None
    if text[i] != "{":
        raise _Malformed(text[i : i + 20])
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return members, None
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            if i >= len(text):
                return members, None
        if text[i] != '"':
            raise _Malformed(text[i : i + 20])
        key_end = _string_end(text, i)
        if key_end is None:
            return members, None
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return members, None
        if text[i] != ":":
            raise _Malformed(text[i : i + 20])
        start = _skip_ws(text, i + 1)
        end = _value_end(text, start, final)
        members[key] = (start, end)
        if end is None:
            return members, None
        i = end


def json_call(
    text: str, i: int, final: bool, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
) -> tuple[ParsedCall, int | None]:
    """The call ``{"name": ..., "arguments": {...}}`` starting at text[i], and the index after it."""
    members, end = object_members(text, i, final)
    name = None
    span = members.get("name")
    if span is not None and span[1] is not None:
        value = json.loads(text[span[0] : span[1]])
        if not isinstance(value, str):
            raise _Malformed("name")
        name = value
    arguments = ""
    for key in arguments_keys:
        if key in members:
            start, stop = members[key]
            arguments = text[start:stop] if stop is not None else text[start:]
            break
    return ParsedCall(name, arguments, end is not None), end


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _plain(text: str, final: bool, marker: str) -> ParsedOutput:
    """No call opened (yet): the text, less what may be the start of ``marker``."""
    return ParsedOutput(text if final else text[: len(text) - held_back(text, marker)])


Reader = Callable[[int], tuple[list[ParsedCall], int | None]]


def _calls_from(text: str, content: str, final: bool, read: Reader, start: int) -> ParsedOutput:
    """The calls ``read`` finds from ``start``; the whole text as content when they are not calls."""
    try:
        calls, _ = read(start)
    except _Malformed:
        return ParsedOutput(text, (), malformed=True)
    if final and (not calls or not all(c.complete and c.name is not None for c in calls)):
        return ParsedOutput(text, (), malformed=True)
    return ParsedOutput(content, tuple(calls))


# -- the built-in formats -------------------------------------------------------------------


class MarkedJsonToolParser(ToolCallParser):
    """Each call is ``START`` then ``{"name": ..., "arguments": {...}}`` (then anything, an end
    tag say); a base for formats of that shape."""

    START: ClassVar[str]

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return _plain(text, final, self.START)

        def read(pos: int) -> tuple[list[ParsedCall], int | None]:
            calls: list[ParsedCall] = []
            while pos >= 0:
                call, end = json_call(text, pos + len(self.START), final)
                calls.append(call)
                if end is None:
                    return calls, None
                pos = text.find(self.START, end)
            return calls, len(text)

        return _calls_from(text, text[:start], final, read, start)


class HermesToolParser(MarkedJsonToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more (the tags are
    ordinary added tokens in Qwen's and Hermes' tokenizers: special tokens stay skipped)."""

    name = "hermes"
    START = "<tool_call>"
    call_format = CallFormat(START, '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>")


class Llama3JsonToolParser(ToolCallParser):
    """A JSON ``{"name": ..., "parameters": {...}}`` (or ``arguments``), optionally after
    ``<|python_tag|>``, several separated by ``;``; text before the first is content."""

    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|>
    PYTHON_TAG = "<|python_tag|>"
    OPENING = re.compile(r'\{\s*"name"\s*:')
    # What may still become OPENING at the end of the text.
    _PARTIAL = re.compile(r'\{\s*("(n(a(m(e("\s*)?)?)?)?)?)?$')
    call_format = CallFormat('{"name": ', '{{"name": "{name}", "parameters": ', "}")

    def parse(self, text: str, final: bool) -> ParsedOutput:
        tag = text.find(self.PYTHON_TAG)
        m = self.OPENING.search(text)
        starts = [s for s in (tag, m.start() if m else -1) if s >= 0]
        if not starts:
            if final:
                return ParsedOutput(text)
            partial = self._PARTIAL.search(text)
            keep = partial.start() if partial else len(text)
            return ParsedOutput(text[: min(keep, len(text) - held_back(text, self.PYTHON_TAG))])
        start = min(starts)
        body = start + len(self.PYTHON_TAG) if start == tag else start

        def read(pos: int) -> tuple[list[ParsedCall], int | None]:
            calls: list[ParsedCall] = []
            while True:
                call, end = json_call(text, pos, final)
                calls.append(call)
                if end is None:
                    return calls, None
                pos = _skip_ws(text, end)
                if pos >= len(text) or text[pos] != ";":
                    return calls, end
                pos += 1
                if _skip_ws(text, pos) >= len(text):
                    return calls, None

        return _calls_from(text, text[:start], final, read, body)


class MistralToolParser(ToolCallParser):
    """``[TOOL_CALLS]`` then a JSON array of calls, or (v11 tokenizers) ``name[ARGS]{json}``,
    each call after its own ``[TOOL_CALLS]``."""

    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS], [ARGS]
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    call_format = CallFormat(START, "[TOOL_CALLS]{name}[ARGS]", "")

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return _plain(text, final, self.START)
        return _calls_from(text, text[:start], final, self._read(text, final), start)

    def _read(self, text: str, final: bool) -> Reader:
        def read(pos: int) -> tuple[list[ParsedCall], int | None]:
            body = _skip_ws(text, pos + len(self.START))
            if body < len(text) and text[body] == "[":
                return self._array(text, body + 1, final)
            calls: list[ParsedCall] = []
            while pos >= 0:
                name_start = pos + len(self.START)
                args = text.find(self.ARGS, name_start)
                if args < 0:
                    if final:
                        raise _Malformed("[ARGS]")
                    return [*calls, ParsedCall(None, "", False)], None
                name = text[name_start:args].strip()
                arg_start = args + len(self.ARGS)
                end = _value_end(text, _skip_ws(text, arg_start), final)
                arguments = text[arg_start:end] if end is not None else text[arg_start:]
                calls.append(ParsedCall(name or None, arguments.strip(), end is not None))
                if end is None:
                    return calls, None
                pos = text.find(self.START, end)
            return calls, len(text)

        return read

    @staticmethod
    def _array(text: str, pos: int, final: bool) -> tuple[list[ParsedCall], int | None]:
        calls: list[ParsedCall] = []
        while True:
            pos = _skip_ws(text, pos)
            if pos >= len(text):
                return calls, None
            if text[pos] == "]":
                return calls, pos + 1
            if text[pos] == ",":
                pos += 1
                continue
            call, end = json_call(text, pos, final)
            calls.append(call)
            if end is None:
                return calls, None
            pos = end


class NamedToolParser(ToolCallParser):
    """``tool_choice`` naming a function: the whole output is that function's arguments (the
    grammar allows nothing else), its name known from the start."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", (ParsedCall(self.function, text, final),))


class RequiredToolParser(ToolCallParser):
    """``tool_choice: "required"``: the output is one ``{"name": ..., "arguments": {...}}``."""

    name = "required"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        try:
            call, _ = json_call(text, 0, final, ("arguments",))
        except _Malformed:
            return ParsedOutput(text, (), malformed=True)
        if final and not (call.complete and call.name is not None):
            return ParsedOutput(text, (), malformed=True)
        return ParsedOutput("", (call,))


# -- the registry -----------------------------------------------------------------------------

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}
DEFAULT_TOOL_CALL_PARSER = HermesToolParser.name  # cluster.config's tool_call_parser default; a test holds them equal


def load_tool_call_parser(name: str) -> ToolCallParser:
    """The parser registered as ``name``, or the ``ToolCallParser`` subclass at
    ``dotted.module:ClassName``; ValueError naming ``tool_call_parser`` otherwise."""
    if name in TOOL_CALL_PARSERS:
        return TOOL_CALL_PARSERS[name]()
    module_name, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(
            f"tool_call_parser: {name!r} is not one of {', '.join(TOOL_CALL_PARSERS)} "
            "nor a class as 'dotted.module:ClassName'"
        )
    try:
        obj: object = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tool_call_parser: {name!r} could not be loaded ({type(exc).__name__}: {exc})") from exc
    if not (inspect.isclass(obj) and issubclass(obj, ToolCallParser)) or inspect.isabstract(obj):
        raise ValueError(f"tool_call_parser: {name!r} is not a concrete ToolCallParser subclass")
    return obj()

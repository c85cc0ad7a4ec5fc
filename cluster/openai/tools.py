"""Chat tools: which tool calls ``tool_choice`` allows, the constraint that enforces it, and how
the output becomes tool calls, whole (``ToolCalling.message``) or streamed (``ToolCallStream``).

- ``"none"`` (or no tools): text.
- ``"required"``: the output is constrained to ``{"name": ..., "arguments": {...}}`` for one of
  the tools; ``finish_reason`` ``tool_calls``.
- a named function: the output is constrained to its arguments; ``finish_reason`` stays as
  generated (``stop``), as OpenAI answers a forced function.
- ``"auto"`` (the default with tools): the model decides; its text is read by the configured
  tool-call parser (cluster.openai.tool_parsers). With ``tool_call_constrained`` (the config's,
  or the request's own field) a grammar allows free text or, once the parser's opening marker is
  generated, only a call of one of the tools with schema-valid arguments (xgrammar's structural
  tags). A call found: ``finish_reason`` ``tool_calls``.

Output that does not parse as the calls it began (cut by ``length``, say) stays plain content.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from cluster.openai.shapes import AssistantMessage, FunctionCallDelta, ToolCall, ToolCallDelta
from cluster.openai.structured import any_call_schema, tool_functions
from cluster.openai.tool_parsers import (
    NamedToolParser,
    ParsedCall,
    ParsedOutput,
    RequiredToolParser,
    ToolCallParser,
)
from worker.structured_outputs import StructuredOutputsParams

# The most whitespace characters in a row a constrained call's arguments may hold: enough for
# JSON indented by a model, not an unbounded run (which a grammar would otherwise allow).
ARGUMENTS_WHITESPACE = 8


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCalling:
    """How one request's output becomes tool calls: read by ``parser``, constrained by
    ``constraint`` (None: unconstrained auto), ``named``: a forced function (finish as generated);
    ``parallel`` false (the request's ``parallel_tool_calls``): the first call only."""

    parser: ToolCallParser
    constraint: StructuredOutputsParams | None
    named: bool = False
    parallel: bool = True

    def calls(self, parsed: ParsedOutput) -> tuple[ParsedCall, ...]:
        return parsed.calls if self.parallel else parsed.calls[:1]

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        """``tool_calls`` once a call was made, except for a named function (as generated)."""
        if called and reason is not None and reason != "error" and not self.named:
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> tuple[AssistantMessage, str | None]:
        """The assistant message and finish_reason of a whole output."""
        parsed = self.parser.parse(text, final=True)
        calls = [] if parsed.malformed else [_call(c) for c in self.calls(parsed)]
        if not calls or any(c is None for c in calls):
            return {"role": "assistant", "content": text}, reason
        tool_calls = [c for c in calls if c is not None]
        message: AssistantMessage = {"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls}
        return message, self.finish_reason(True, reason)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def _call(c: ParsedCall) -> ToolCall | None:
    """A parsed call as the response's tool call; None unless whole, named and valid JSON."""
    if not c.complete or c.name is None:
        return None
    try:
        json.loads(c.arguments)
    except ValueError:
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


@dataclass
class ToolCallStream:
    """One choice's stream: each ``feed`` of new text gives the content and tool-call deltas it
    adds (OpenAI's and vLLM's shape: a call's first delta carries id, type, name and the arguments
    known so far, possibly "", later ones argument text; one entry per call in a chunk, as OpenAI
    sends); the arguments sent add up to the call's arguments."""

    calling: ToolCalling
    text: str = ""
    _content_sent: int = 0
    _args_sent: list[int] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self._args_sent)

    def feed(self, delta: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        parsed = self.calling.parser.parse(self.text, final)
        content = parsed.content
        if parsed.malformed:
            # Not a call after all: content, once known, unless a call was already sent.
            content = "" if self.called or not final else self.text
        out_content = content[self._content_sent :] if len(content) > self._content_sent else ""
        self._content_sent = max(self._content_sent, len(content))
        deltas: list[ToolCallDelta] = []
        if parsed.malformed:
            return out_content, deltas
        for i, call in enumerate(self.calling.calls(parsed)):
            if i == len(self._args_sent):
                if call.name is None:
                    break  # a call's name goes out whole, and calls in order
                self._args_sent.append(len(call.arguments))
                fn: FunctionCallDelta = {"name": call.name, "arguments": call.arguments}
                deltas.append({"index": i, "id": new_call_id(), "type": "function", "function": fn})
                continue
            sent = self._args_sent[i]
            if len(call.arguments) > sent:
                deltas.append({"index": i, "function": {"arguments": call.arguments[sent:]}})
                self._args_sent[i] = len(call.arguments)
        return out_content, deltas


def tool_calling(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parser: ToolCallParser,
    constrained: bool,
    parallel: bool = True,
) -> ToolCalling | None:
    """What ``tool_choice`` asks of the output (None: text); ValueError naming the field.
    ``parallel`` false: at most one call (the constraint ends after it)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice: requires tools")
        return None
    fns = tool_functions(tools)
    if tool_choice == "none":
        return None
    if tool_choice is None or tool_choice == "auto":
        constraint = _auto_constraint(parser, json.dumps(fns), parallel) if constrained else None
        return ToolCalling(parser, constraint, parallel=parallel)
    if tool_choice == "required":
        return ToolCalling(RequiredToolParser(), StructuredOutputsParams(json=any_call_schema(fns), source="tools"))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in fns:
            raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools ({', '.join(fns)})")
        so = StructuredOutputsParams(json=fns[name], source=f"tools[{name}].function.parameters")
        return ToolCalling(NamedToolParser(name), so, named=True)
    raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a function, got {tool_choice!r}")


def _auto_constraint(parser: ToolCallParser, functions: str, parallel: bool) -> StructuredOutputsParams:
    fmt = parser.call_format
    if fmt is None:
        raise ValueError(
            f"tool_call_constrained: the tool-call parser {parser.name or type(parser).__name__!r} "
            "does not say how a call is written (call_format); unset it or use another parser"
        )
    grammar = _structural_grammar(fmt.trigger, fmt.begin, fmt.end, functions, parallel)
    return StructuredOutputsParams(grammar=grammar, source="tools")


@functools.lru_cache(maxsize=64)
def _structural_grammar(trigger: str, begin: str, end: str, functions: str, parallel: bool) -> str:
    """Free text, or after ``trigger`` a call of one of ``functions`` (name -> parameters
    schema, as JSON) with schema-valid arguments, then free text again (``parallel``) or the end:
    xgrammar's structural tag, as the EBNF it compiles to (one grammar constraint, compiled like
    any other)."""
    import xgrammar

    fns: dict[str, Any] = json.loads(functions)
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [trigger],
            "tags": [
                {
                    "begin": begin.format(name=name),
                    "content": {
                        "type": "json_schema",
                        "json_schema": params,
                        "max_whitespace_cnt": ARGUMENTS_WHITESPACE,
                    },
                    "end": end,
                }
                for name, params in fns.items()
            ],
            "at_least_one": False,
            "stop_after_first": not parallel,
        },
    }
    try:
        return str(xgrammar.Grammar.from_structural_tag(json.dumps(tag)))
    except Exception as exc:  # xgrammar's errors for a schema it cannot take: the request's 400
        raise ValueError(f"tools: cannot build the tool-call grammar ({type(exc).__name__}: {exc})"[:500]) from exc

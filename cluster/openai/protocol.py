"""The OpenAI-compatible HTTP schema (plus vLLM's extra sampling fields) and its conversion.

Request bodies are converted once, here, to ``worker.SamplingParams``; responses are built here
from the engine's ``RequestOutput``. Unknown body fields are ignored, as OpenAI-compatible
servers do, so newer SDKs keep working; known fields this server does not implement (OpenAI's and
vLLM's) are a 400 naming them (cluster.openai.unimplemented).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.chat import ChatRender, PromptTokens, Turn
from cluster.openai import unimplemented
from cluster.openai.shapes import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatDelta,
    ChatLogprobs,
    ChatResponse,
    ChatTail,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionResponse,
    ObjectName,
    PromptLogprobs,
    ResponseHead,
    TokenizeResponse,
    ToolCallDelta,
    Usage,
    UsageChunk,
)
from cluster.openai.structured import structured_from_fields
from cluster.openai.tool_parsers import DEFAULT_TOOL_CALL_PARSER, ToolCallParser, load_tool_call_parser
from cluster.openai.tools import ToolCalling, tool_calling
from cluster.openai.unimplemented import Unimplemented
from worker.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from worker.sampling_params import INT64_MAX, SamplingParams

LOGIT_BIAS_LIMIT = 100.0


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Refusing(BaseModel):
    """A request body: unknown fields ignored, known ones it does not implement refused when set
    (``unimplemented_fields``, from cluster.openai.unimplemented)."""

    model_config = ConfigDict(extra="ignore")
    unimplemented_fields: ClassVar[Mapping[str, Unimplemented]] = {}

    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_implemented(cls, body: Any) -> Any:
        unimplemented.reject(body, cls.unimplemented_fields)
        return body


class _SamplingFields(_Refusing):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    unimplemented_fields = unimplemented.SAMPLING

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    logprobs_mode: str | None = None
    vllm_xargs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    # vLLM's extension: each choice (and stream chunk) also carries the generated token ids, and
    # the prompt's (per completions choice; at the top of a chat response).
    return_token_ids: bool | None = None
    # vLLM's extension: the tokenizer's special tokens (a BOS) on the prompt; its default differs
    # per endpoint (true for completions, false for chat: the template writes its own).
    add_special_tokens: bool = True
    # vLLM's extension: keep only the last k prompt tokens (first k with truncation_side "right";
    # -1: max_model_len); k past max_model_len is a 400 (cluster.chat.PromptTokens).
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's extension: a matched stop string stays at the end of the text.
    include_stop_str_in_output: bool = False
    # vLLM's extension: logprobs of the prompt tokens (response field `prompt_logprobs`).
    prompt_logprobs: int | None = None
    # vLLM's extension: lower is admitted sooner (worker.fairness: among one API key's requests,
    # never beyond a fair share while others wait). The gRPC field's range.
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    # Structured outputs: at most one (cluster/openai/structured.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _stream_options_not_implemented(cls, body: Any) -> Any:
        if isinstance(body, dict):
            unimplemented.reject(body.get("stream_options"), unimplemented.STREAM_OPTIONS, "stream_options.")
        return body

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def _sampling_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"n": self.n}
        for name in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "seed",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "stop_token_ids",
            "bad_words",
            "allowed_token_ids",
            "skip_special_tokens",
            "logprobs_mode",
            "prompt_logprobs",
        ):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.logit_bias is not None:
            # OpenAI clamps biases to [-100, 100]; keys are token ids as strings.
            kw["logit_bias"] = {
                k: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, v)) if math.isfinite(v) else v
                for k, v in self.logit_bias.items()
            }
        if self.vllm_xargs is not None and self.extra_args is not None:
            raise ValueError("vllm_xargs: give either vllm_xargs or extra_args, not both")
        xargs = self.vllm_xargs if self.vllm_xargs is not None else self.extra_args
        if xargs is not None:
            kw["extra_args"] = dict(xargs)
        guided = {
            name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        }
        so = structured_from_fields(self.response_format, self.structured_outputs, guided)
        if so is not None:
            kw["structured_outputs"] = so
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def prompt_tokens(self) -> PromptTokens:
        """How the prompt becomes token ids (special tokens, truncation)."""
        return PromptTokens(self.add_special_tokens, self.truncate_prompt_tokens, self.truncation_side or "left")


class CompletionRequest(_SamplingFields):
    unimplemented_fields = unimplemented.COMPLETION

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _no_suffix(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix: not supported by this server")
        return self

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: only the prompt comes back (how lm-eval scores loglikelihood)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self) -> SamplingParams:
        kw = self._sampling_kwargs()
        if self.max_tokens is not None:
            # vLLM generates one token for echo-only requests and drops it from the response.
            kw["max_tokens"] = 1 if self.echo_only else self.max_tokens
        if self.logprobs is not None:
            kw["logprobs"] = self.logprobs
            if self.echo and self.prompt_logprobs is None:
                kw["prompt_logprobs"] = self.logprobs  # the echoed prompt's logprobs, as vLLM
        return SamplingParams(**kw)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            p = [p]
        # An empty list or prompt is the front end's 400 (cluster.frontend.check_prompts).
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]  # all ints: the list[int] member (all() does not narrow)
        return list(p)  # type: ignore[arg-type]  # list[str] or list[list[int]], each item a prompt


class MessageFunction(BaseModel):
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (an agent sends them back with the tools' results)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: MessageFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None

    def turn(self, parser: ToolCallParser | None = None) -> Turn:
        """(role, text) for the front end: an assistant turn's earlier calls written after its
        text as the model writes them (``parser``'s format), so the next turn sees them."""
        text = self.text()
        for call in self.tool_calls or ():
            text += (parser or _DEFAULT_PARSER).render_call(call.function.name, call.function.arguments)
        return self.role, text

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages: content part type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class _ChatPrompt(BaseModel):
    """A chat as a prompt (chat completions and /tokenize): its messages, how the template
    renders them (vLLM's fields) and no special tokens added on top by default."""

    messages: list[ChatMessage] = Field(min_length=1)
    # The functions the model may call: given to the chat template (as vLLM does) and, in chat,
    # what tool_choice chooses among (cluster.openai.tools).
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def render(self) -> ChatRender:
        """How the chat template renders the messages (ValueError if both flags are set)."""
        return ChatRender(self.add_generation_prompt, self.continue_final_message)


_DEFAULT_PARSER = load_tool_call_parser(DEFAULT_TOOL_CALL_PARSER)


class ChatCompletionRequest(_ChatPrompt, _SamplingFields):
    unimplemented_fields = unimplemented.CHAT

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (tool_choice auto; forced is one)
    # This server's extension: constrain tool_choice "auto" (cluster.openai.tools); None: the config's.
    tool_call_constrained: bool | None = None

    def tool_calling(self, parser: ToolCallParser | None = None, constrained: bool = False) -> ToolCalling | None:
        """How the output becomes tool calls (None: text); ``parser`` and ``constrained``: the
        server's configured tool-call format and default for ``auto``. ValueError for bad tools."""
        if self.tool_call_constrained is not None:
            constrained = self.tool_call_constrained
        parallel = self.parallel_tool_calls is not False
        return tool_calling(self.tools, self.tool_choice, parser or _DEFAULT_PARSER, constrained, parallel)

    def sampling_params(self, tools: ToolCalling | Literal["from_request"] | None = "from_request") -> SamplingParams:
        """``tools``: the request's ``tool_calling`` (computed here with the defaults unless given)."""
        kw = self._sampling_kwargs()
        tool = self.tool_calling() if tools == "from_request" else tools
        if tool is not None and tool.constraint is not None:
            if "structured_outputs" in kw:
                raise ValueError("tool_choice: cannot be combined with another output constraint")
            kw["structured_outputs"] = tool.constraint
        if tool is not None and tool.parser.needs_special_tokens and self.skip_special_tokens is None:
            kw["skip_special_tokens"] = False  # the format's markers are special tokens in its models
        # Neither given: up to the remaining context (vLLM), cut to it by fit_to_context.
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise ValueError(f"max_completion_tokens: must be an integer >= 1, got {self.max_completion_tokens}")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kw["max_tokens"] = max_tokens if max_tokens is not None else INT64_MAX
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        elif self.top_logprobs:
            raise ValueError("top_logprobs: requires logprobs=true")
        return SamplingParams(**kw)


# -- responses (typed: cluster.openai.shapes) -------------------------------------------------

# One token's text (the front end's decode_token): how logprobs name tokens.
Decode = Callable[[int], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """`created`: taken once per request, so every chunk of a stream carries the same value."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cached_tokens(outs: Sequence[RequestOutput]) -> int:
    """The prompt tokens of ``outs`` served from the prefix cache (0 where the worker said none)."""
    return sum(out.num_cached_tokens or 0 for out in outs)


def completion_logprobs(c: CompletionOutput, decode: Decode, text_offset: int = 0) -> CompletionLogprobs | None:
    """OpenAI's legacy completions logprobs object; offsets count from ``text_offset`` (the
    length of the text already sent for this choice, when streaming)."""
    if c.logprobs is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    positions: Sequence[PositionLogprobs | None] = c.logprobs
    for tok, position in zip(c.token_ids, positions):  # None: an echoed prompt's first token
        text = decode(tok)
        offsets.append(text_offset)
        text_offset += len(text)
        tokens.append(text)
        token_logprobs.append(None if position is None else position[tok].logprob)
        top.append(None if position is None else {decode(t): lp.logprob for t, lp in position.items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


@dataclass(frozen=True)
class Echo:
    """The prompt a completion choice starts with (`echo`); ``only``: max_tokens was 0."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None] | None
    only: bool = False


def echoed(c: CompletionOutput, e: Echo) -> CompletionOutput:
    """``c`` with the prompt in front: text, token ids and (when asked for) logprobs, prompt first."""
    lps = None if c.logprobs is None else list(e.logprobs or [None] * len(e.token_ids))
    if e.only:
        finish = "length" if c.finish_reason is not None and c.finish_reason != "error" else c.finish_reason
        return CompletionOutput(c.index, e.text, list(e.token_ids), None, lps, finish, None, c.error)  # type: ignore[arg-type]  # lps[0] is None: the prompt's first token has no logprob
    if lps is not None and c.logprobs is not None:
        lps.extend(c.logprobs)
    return CompletionOutput(
        c.index,
        e.text + c.text,
        [*e.token_ids, *c.token_ids],
        c.cumulative_logprob,
        lps,  # type: ignore[arg-type]  # the prompt's position 0 has no logprob: None (completion_logprobs reads it)
        c.finish_reason,
        c.stop_reason,
        c.error,
    )


def after_echo(c: CompletionOutput, e: Echo) -> CompletionOutput:
    """A later stream delta of an echo-only choice: nothing generated is shown, only the finish."""
    if not e.only:
        return c
    finish = "length" if c.finish_reason is not None and c.finish_reason != "error" else c.finish_reason
    return CompletionOutput(c.index, "", [], None, None if c.logprobs is None else [], finish, None, c.error)


def prompt_logprobs_json(plp: Sequence[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` field: per prompt token, None or {token id: {logprob, rank, decoded_token}}."""
    if plp is None:
        return None
    return [
        None
        if position is None
        else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in position.items()
        }
        for position in plp
    ]


def chat_logprobs(c: CompletionOutput, decode: Decode, top_n: int) -> ChatLogprobs | None:
    if c.logprobs is None:
        return None
    content: list[ChatTokenLogprob] = []
    for tok, position in zip(c.token_ids, c.logprobs):
        text = decode(tok)
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank)[:top_n]
        content.append(
            {
                "token": text,
                "logprob": position[tok].logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": decode(t), "logprob": lp.logprob, "bytes": list(decode(t).encode())} for t, lp in ranked
                ],
            }
        )
    return {"content": content}


def output_text(c: CompletionOutput, include_stop: bool) -> str:
    """The text, with the matched stop string put back when the request asked for it."""
    if include_stop and c.finish_reason == "stop" and isinstance(c.stop_reason, str):
        return c.text + c.stop_reason
    return c.text


def completion_usage(outs: Sequence[RequestOutput], echoes: Sequence[Echo] | None = None) -> Usage:
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
    completion_tokens = sum(
        len(c.token_ids) for i, out in enumerate(outs) for c in out.outputs if echoes is None or not echoes[i].only
    )
    return usage(prompt_tokens, completion_tokens, cached_tokens(outs))


def completion_choices(
    outs: Sequence[RequestOutput],
    decode: Decode,
    token_ids: bool = False,
    include_stop: bool = False,
    echoes: Sequence[Echo] | None = None,
) -> Iterator[CompletionChoice]:
    """The choices of a completions response, one at a time (a large response is written as they
    come, cluster.openai.wire.json_chunks). A prompt's `prompt_logprobs` are converted once and the
    same list is every one of its choices' (the JSON repeats them per choice, as vLLM's). vLLM's
    shape: `token_ids` (generated only, an echoed prompt not among them), `prompt_logprobs` and
    `prompt_token_ids` are in every choice, null unless asked for."""
    for i, out in enumerate(outs):
        plp = prompt_logprobs_json(out.prompt_logprobs)
        only = echoes is not None and echoes[i].only
        for c in out.outputs:
            shown = c if echoes is None else echoed(c, echoes[i])
            yield {
                "index": i * len(out.outputs) + c.index,
                "text": output_text(shown, include_stop),
                "logprobs": completion_logprobs(shown, decode),
                "finish_reason": shown.finish_reason,
                "stop_reason": shown.stop_reason,
                "token_ids": ([] if only else list(c.token_ids)) if token_ids else None,
                "prompt_logprobs": plp,
                "prompt_token_ids": list(out.prompt_token_ids) if token_ids else None,
            }


def _head(rid: str, obj: ObjectName, model: str, created: int | None = None) -> ResponseHead:
    return {"id": rid, "object": obj, "created": now() if created is None else created, "model": model}


def completion_head(rid: str, model: str) -> ResponseHead:
    """A completions response's fields before `choices` (and `usage`, after them)."""
    return _head(rid, "text_completion", model)


def completion_response(
    rid: str,
    model: str,
    outs: list[RequestOutput],
    decode: Decode,
    token_ids: bool = False,
    include_stop: bool = False,
    echoes: Sequence[Echo] | None = None,
) -> CompletionResponse:
    """``echoes``: per prompt, what `echo` puts in front of each of its choices."""
    return {
        **completion_head(rid, model),
        "choices": list(completion_choices(outs, decode, token_ids, include_stop, echoes)),
        "usage": completion_usage(outs, echoes),
    }


def _chat_choice(
    c: CompletionOutput, decode: Decode, top_n: int, tool: ToolCalling | None, include_stop: bool, token_ids: bool
) -> ChatChoice:
    message: AssistantMessage = {"role": "assistant", "content": output_text(c, include_stop)}
    reason = c.finish_reason
    if tool is not None:
        message, reason = tool.message(message["content"] or "", reason)
    return {
        "index": c.index,
        "message": message,
        "logprobs": chat_logprobs(c, decode, top_n),
        "finish_reason": reason,
        "stop_reason": c.stop_reason,
        "token_ids": list(c.token_ids) if token_ids else None,  # vLLM's shape: null unless asked
    }


def chat_choices(
    out: RequestOutput,
    decode: Decode,
    top_n: int,
    token_ids: bool = False,
    tool: ToolCalling | None = None,
    include_stop: bool = False,
) -> Iterator[ChatChoice]:
    for c in out.outputs:
        yield _chat_choice(c, decode, top_n, tool, include_stop, token_ids)


def chat_head(rid: str, model: str) -> ResponseHead:
    return _head(rid, "chat.completion", model)


def chat_tail(out: RequestOutput, token_ids: bool = False) -> ChatTail:
    """A chat response's fields after `choices`: usage, and (vLLM's, null unless asked for) the
    prompt's logprobs and token ids, once."""
    n_out = sum(len(c.token_ids) for c in out.outputs)
    return {
        "usage": usage(len(out.prompt_token_ids), n_out, cached_tokens([out])),
        "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs),
        "prompt_token_ids": list(out.prompt_token_ids) if token_ids else None,
    }


def chat_response(
    rid: str,
    model: str,
    out: RequestOutput,
    decode: Decode,
    top_n: int,
    token_ids: bool = False,
    tool: ToolCalling | None = None,
    include_stop: bool = False,
) -> ChatResponse:
    return {
        **chat_head(rid, model),
        "choices": list(chat_choices(out, decode, top_n, token_ids, tool, include_stop)),
        **chat_tail(out, token_ids),
    }


def completion_chunk(
    rid: str,
    model: str,
    c: CompletionOutput,
    decode: Decode,
    index_base: int = 0,
    token_ids: list[int] | None = None,
    *,
    created: int,
    text_offset: int = 0,
    include_stop: bool = False,
    prompt_token_ids: list[int] | None = None,
) -> CompletionChunk:
    """One stream chunk; ``token_ids``: the generated ids it adds, ``prompt_token_ids``: the
    prompt's, in a choice's first chunk (both when return_token_ids asks)."""
    choice: CompletionChunkChoice = {
        "index": index_base + c.index,
        "text": output_text(c, include_stop),
        "logprobs": completion_logprobs(c, decode, text_offset),
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    return {**_head(rid, "text_completion", model, created), "choices": [choice]}


@dataclass(frozen=True)
class ToolDelta:
    """What a choice's ToolCallStream made of one output delta: content, tool-call deltas, and
    the finish_reason as the tools decide it."""

    content: str
    calls: list[ToolCallDelta]
    finish_reason: str | None


def chat_chunk(
    rid: str,
    model: str,
    c: CompletionOutput,
    decode: Decode,
    top_n: int,
    first: bool,
    token_ids: bool = False,
    *,
    created: int,
    include_stop: bool = False,
    prompt_token_ids: list[int] | None = None,
    tool_delta: ToolDelta | None = None,
) -> ChatChunk:
    """One stream chunk; with ``token_ids`` the ids it adds, and in a choice's ``first`` chunk
    the prompt's ``prompt_token_ids`` at the top (vLLM's). ``tool_delta``: with tools, what the
    choice's ToolCallStream made of it."""
    delta: ChatDelta = {"content": output_text(c, include_stop)}
    reason = c.finish_reason
    if tool_delta is not None:
        delta = {"content": tool_delta.content} if tool_delta.content or not tool_delta.calls else {}
        if tool_delta.calls:
            delta["tool_calls"] = tool_delta.calls
        reason = tool_delta.finish_reason
    if first:
        delta["role"] = "assistant"
    choice: ChatChunkChoice = {
        "index": c.index,
        "delta": delta,
        "logprobs": chat_logprobs(c, decode, top_n),
        "finish_reason": reason,
        "stop_reason": c.stop_reason,
    }
    if token_ids:
        choice["token_ids"] = list(c.token_ids)
    chunk: ChatChunk = {**_head(rid, "chat.completion.chunk", model, created), "choices": [choice]}
    if first and token_ids and prompt_token_ids is not None:
        chunk["prompt_token_ids"] = list(prompt_token_ids)
    return chunk


def usage_chunk(
    rid: str, model: str, obj: Literal["text_completion", "chat.completion.chunk"], u: Usage, *, created: int
) -> UsageChunk:
    return {**_head(rid, obj, model, created), "choices": [], "usage": u}


# -- /tokenize and /detokenize (vLLM's shapes) ---------------------------------------------


class TokenizeCompletionRequest(_Refusing):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatPrompt, _Refusing):
    unimplemented_fields = unimplemented.TOKENIZE_CHAT

    return_token_strs: bool | None = False


def tokenize_request(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's /tokenize body: the chat form when it has `messages`, else the prompt form."""
    if isinstance(body, dict) and "messages" in body:
        return TokenizeChatRequest.model_validate(body)
    return TokenizeCompletionRequest.model_validate(body)


class DetokenizeRequest(_Refusing):
    tokens: list[int]


def tokenize_response(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> TokenizeResponse:
    """vLLM's TokenizeResponse."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}

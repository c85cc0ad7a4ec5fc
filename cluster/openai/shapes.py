"""Typed shapes of what the OpenAI-compatible server answers: OpenAI's objects (and vLLM's extra
fields), as TypedDicts.

cluster.openai.protocol and cluster.openai.tools build them and cluster.openai.wire writes them:
a TypedDict is the JSON object itself, so the type checker holds every builder to the shape while
nothing is converted on the way out (a logprobs response can hold a vocabulary's worth of entries
per token). Key order is the order the builders write (the wire's order). ``NotRequired``: a key
that is absent in some answers and never null there (vLLM's, and the stream's first-chunk fields).
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

# -- usage and logprobs ---------------------------------------------------------------------------


class PromptTokensDetails(TypedDict):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(TypedDict):
    """The legacy completions logprobs: per token its text, logprob (None: an echoed prompt's
    first token), top alternatives by text, and character offset."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]


class PromptLogprob(TypedDict):
    """vLLM's per-candidate prompt logprob."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# Per prompt token: None (the first) or {token id as a string: its PromptLogprob}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]

# -- tool calls -----------------------------------------------------------------------------------


class FunctionCall(TypedDict):
    name: str
    arguments: str  # the arguments as JSON text, as OpenAI sends them


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionCallDelta(TypedDict):
    """A streamed call's piece: the name (first delta only, with arguments "") or more arguments."""

    name: NotRequired[str]
    arguments: str


class ToolCallDelta(TypedDict):
    """``index``: which of the choice's calls; ``id`` and ``type`` on its first delta only."""

    index: int
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: FunctionCallDelta


# -- completions ----------------------------------------------------------------------------------


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None
    token_ids: list[int] | None  # vLLM's: generated ids, null unless return_token_ids
    prompt_logprobs: PromptLogprobs | None
    prompt_token_ids: list[int] | None


ObjectName = Literal["text_completion", "chat.completion", "chat.completion.chunk"]


class ResponseHead(TypedDict):
    """The fields every response and chunk starts with."""

    id: str
    object: ObjectName
    created: int
    model: str


class CompletionResponse(ResponseHead):
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None
    token_ids: NotRequired[list[int]]
    prompt_token_ids: NotRequired[list[int]]


class CompletionChunk(ResponseHead):
    choices: list[CompletionChunkChoice]


# -- chat -----------------------------------------------------------------------------------------


class AssistantMessage(TypedDict):
    """A chat choice's message: text, or tool calls (``content``: null or the text before them)."""

    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[ToolCall]]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None
    token_ids: list[int] | None


class ChatTail(TypedDict):
    """A chat response's fields after ``choices`` (vLLM's prompt fields null unless asked)."""

    usage: Usage
    prompt_logprobs: PromptLogprobs | None
    prompt_token_ids: list[int] | None


class ChatResponse(ResponseHead, ChatTail):
    choices: list[ChatChoice]


class ChatDelta(TypedDict):
    """A stream chunk's delta: text (absent when a tool-call delta carries none), tool-call
    deltas, and the role in a choice's first chunk."""

    content: NotRequired[str]
    tool_calls: NotRequired[list[ToolCallDelta]]
    role: NotRequired[Literal["assistant"]]


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None
    token_ids: NotRequired[list[int]]


class ChatChunk(ResponseHead):
    choices: list[ChatChunkChoice]
    prompt_token_ids: NotRequired[list[int]]


class UsageChunk(ResponseHead):
    """A stream's last chunk when stream_options.include_usage asks: no choices, the usage."""

    choices: list[CompletionChunkChoice | ChatChunkChoice]
    usage: Usage


# -- models -------------------------------------------------------------------------------------


class ModelCard(TypedDict):
    """OpenAI's model object, with vLLM's ``root``, ``parent`` and ``max_model_len``."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


# -- /tokenize and /detokenize (vLLM's) -------------------------------------------------------------


class TokenizeResponse(TypedDict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(TypedDict):
    prompt: str

"""What a caller holds: immutable results, free of protobuf (conversion lives in convert.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0
    """Prompt tokens the server found in its prefix cache."""


@dataclass(frozen=True, slots=True)
class Logprob:
    """One candidate token at a position."""

    token_id: int
    logprob: float
    rank: int  # 1-based
    token: str = ""  # decoded text, when the server sends it


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs at one output position: the sampled token and the top candidates."""

    token_id: int
    logprob: float
    rank: int  # 1-based: count(logprob >= sampled logprob)
    token: str = ""
    top: tuple[Logprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Choice:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "length" | "stop" | "abort" | "error"
    logprobs: tuple[TokenLogprobs, ...] = ()
    cumulative_logprob: float | None = None
    error: str | None = None  # set when finish_reason == "error"


@dataclass(frozen=True, slots=True)
class Completion:
    """The result of ``generate``: the first choice's fields at top level, all of them in ``choices``."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple[TokenLogprobs, ...]
    usage: Usage
    choices: tuple[Choice, ...]
    cumulative_logprob: float | None = None
    error: str | None = None
    # One per prompt token when ``prompt_logprobs`` was asked for; the first is None.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """What a stream yields: new text and tokens of choice ``index`` since its previous chunk.

    ``finish_reason`` is set on the chunk that finishes the choice; ``usage`` on the last chunk.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    usage: Usage | None = None
    request_id: str = ""
    error: str | None = None
    # On the request's first chunk, when ``prompt_logprobs`` was asked for (see Completion).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class ProcessorInfo:
    """A logits processor loaded by the workers, and the ``extra_args`` it reads."""

    name: str
    fqcn: str
    argmax_invariant: bool
    extra_args_keys: tuple[str, ...] = ()
    extra_args_schema: dict[str, Any] | None = None

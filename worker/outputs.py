"""What the engine hands back: vLLM's field names, so its users feel at home."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class Logprob:
    logprob: float
    # 1-based rank of the token in its row (1 = the most likely).
    rank: int
    decoded_token: str | None = None


# What a -inf (or NaN) logprob is reported as (vLLM's value): JSON carries no NaN or Infinity.
LOGPROB_FLOOR = -9999.0


def wire_logprob(value: float) -> float:
    """A logprob (or raw logit) safe on every wire: -inf and NaN become the floor, +inf the largest float."""
    if value != value or value < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return min(value, sys.float_info.max)


# Per generated position: token id -> Logprob (the sampled token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    # The stop string or stop token id that ended the sequence, if any.
    stop_reason: str | int | None = None
    # Set when finish_reason == "error".
    error: str | None = None
    # Seconds from the engine receiving the sequence to its first step in the batch (vLLM's
    # queue time); set on the sequence's last output only, which the ingress's metrics read.
    queue_time_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # One entry per prompt token (the first is None: nothing precedes it), when the request asked
    # for prompt_logprobs; sent once, in the request's first output.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Prompt tokens whose KV came from the prefix cache when the prompt was first admitted (the
    # fewest over its n sequences; vLLM's field, OpenAI's usage.prompt_tokens_details.cached_tokens).
    # None until one of its sequences is admitted.
    num_cached_tokens: int | None = None


class OutputAccumulator:
    """Merges a request's delta RequestOutputs into the cumulative one (what `LLM` returns).

    Also how consecutive deltas are merged into one (a fresh accumulator per window): the result
    covers exactly the completions those deltas touched.
    """

    def __init__(self) -> None:
        self._out: RequestOutput | None = None
        self._by_index: dict[int, CompletionOutput] = {}

    def add(self, delta: RequestOutput) -> RequestOutput:
        if self._out is None:
            self._out = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids)
        if delta.prompt_logprobs is not None:
            self._out.prompt_logprobs = delta.prompt_logprobs
        if delta.num_cached_tokens is not None:
            self._out.num_cached_tokens = delta.num_cached_tokens
        for d in delta.outputs:
            cur = self._by_index.get(d.index)
            if cur is None:
                cur = CompletionOutput(d.index, "", [], None, [] if d.logprobs is not None else None)
                self._by_index[d.index] = cur
            cur.text += d.text
            cur.token_ids.extend(d.token_ids)
            if d.logprobs is not None and cur.logprobs is not None:
                cur.logprobs.extend(d.logprobs)
            cur.cumulative_logprob = d.cumulative_logprob
            cur.finish_reason = d.finish_reason
            cur.stop_reason = d.stop_reason
            cur.error = d.error
            if d.queue_time_s is not None:
                cur.queue_time_s = d.queue_time_s
        self._out.outputs = [self._by_index[i] for i in sorted(self._by_index)]
        self._out.finished = delta.finished
        return self._out

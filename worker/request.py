"""One running sequence as the engine tracks it (a child of the user's request when n > 1)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from worker.detokenizer import IncrementalDetokenizer
from worker.kv.prefix_cache import BlockHash
from worker.outputs import FinishReason, PositionLogprobs
from worker.sampling_params import SamplingParams

# The id a scheduled token has while it is still on the device (async scheduling).
PLACEHOLDER = -1


@dataclass(frozen=True)
class Scheduling:
    """Whose a request is, for fair admission (worker.fairness): every sequence of one client
    request shares a ``group`` (a multi-prompt completion's prompts too), groups are nested in a
    ``tenant`` (a non-secret id of the API key; "" when keys are off), and ``priority`` orders a
    tenant's own groups (vLLM's field: lower is sooner, default 0)."""

    group: str = ""  # "" = the request's own id
    tenant: str = ""
    priority: int = 0


@dataclass(eq=False)
class Request:
    request_id: str  # unique engine-side id (the parent's id, suffixed for n > 1)
    parent_id: str  # the id the user gave
    index: int  # which of the parent's n completions this is
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    # The live output list: processors hold a reference to this very object.
    output_token_ids: list[int] = field(default_factory=list)
    # Sampled tokens still on the device (async scheduling: the step that sampled them is read
    # after the next one is launched). Counted in num_tokens, not yet in output_token_ids.
    num_placeholders: int = 0
    # Tokens whose KV is written.
    num_computed_tokens: int = 0
    # KV blocks holding this sequence's tokens, in order (worker.kv.manager owns these three).
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    # Seeded requests keep one generator for life, so a preempted one resumes its random stream.
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    # Prompt tokens served from the prefix cache at this sequence's first admission (vLLM's
    # num_cached_tokens: a recomputation after preemption does not change it).
    num_cached_tokens: int | None = None
    in_batch: bool = False
    # This sequence computes its parent's prompt logprobs: its prefill reuses no cached blocks.
    computes_prompt_logprobs: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    # Fair admission (worker.fairness): the client request and API key this sequence belongs to.
    group: str = ""
    tenant: str = ""
    priority: int = 0
    # Position in the waiting queue (worker.fairness.WaitingQueue sets it), and in arrival order.
    order: int = 0
    arrival: int = 0
    # Held out of the batch because its consumer is behind (AsyncEngine's stream bound).
    paused: bool = False
    # When the engine received it (monotonic), and how long it then waited for its first step.
    queued_at: float = field(default_factory=time.monotonic)
    queue_time_s: float | None = None
    # What the last step produced, handed out once as a delta.
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[PositionLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
            self.cumulative_logprob = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, the ones still on the device (placeholders) included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_placeholders

    @property
    def num_known_tokens(self) -> int:
        """Prompt + output tokens whose ids the host has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence;
        PLACEHOLDER where a token is still on the device (the runner feeds it from there)."""
        p = len(self.prompt_token_ids)
        missing = max(0, end - max(start, self.num_known_tokens))
        end -= missing
        if end <= p:
            known = self.prompt_token_ids[start:end]
        elif start >= p:
            known = self.output_token_ids[start - p : end - p]
        else:
            known = self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
        return known + [PLACEHOLDER] * missing if missing else known

    def ends_by_length(self, max_model_len: int) -> bool:
        """Whether its tokens so far (placeholders included) end it by length (max_tokens, or
        the context): no further token is computed for it."""
        return len(self.output_token_ids) + self.num_placeholders >= self.params.max_tokens or (
            self.num_tokens >= max_model_len
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not written yet (1 while decoding; all of them after a preemption)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids) - self.num_placeholders

    def finish(self, reason: FinishReason, *, stop_reason: str | int | None = None, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason
            self.error = error

"""One running sequence as the engine tracks it (a child of the user's request when n > 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.detokenizer import IncrementalDetokenizer
from worker.outputs import FinishReason, PositionLogprobs
from worker.sampling_params import SamplingParams


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
    # Tokens whose KV is written.
    num_computed_tokens: int = 0
    slot: int | None = None
    in_batch: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
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
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.prompt_len

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)

    def finish(self, reason: FinishReason, *, stop_reason: str | int | None = None, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason
            self.error = error

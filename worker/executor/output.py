"""What one ``Executor.execute_model`` call hands back to the scheduler side."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.request import Request
from worker.sampler import PendingSample, SamplerOutput
from worker.scheduler import ScheduledChunk


@dataclass(frozen=True)
class Failure:
    """Requests the executor failed, with their error; ``rebuilt``: the batch state was rebuilt
    after (empty but for the survivors), so the scheduler forgets the rows it meant to remove."""

    requests: tuple[Request, ...]
    error: str
    rebuilt: bool


@dataclass(frozen=True)
class SampledRows:
    """The batch rows that were sampled (row order) and their tokens, already on the host (the
    sampler's one read of the step): the scheduler side turns them into lists without a sync."""

    rows: list[ScheduledChunk]
    output: SamplerOutput


@dataclass(frozen=True)
class PendingRows:
    """Sampled batch rows (row order) whose read is still to come (async scheduling)."""

    rows: list[ScheduledChunk]
    sample: PendingSample

    def row_of(self) -> dict[str, int]:
        """Each row's request id -> its row in ``sample.tokens``."""
        return {c.request.request_id: i for i, c in enumerate(self.rows)}


@dataclass(frozen=True)
class PromptLogits:
    """The extra logits rows of the chunks computing prompt logprobs (``prompt_positions`` each)."""

    chunks: list[ScheduledChunk]
    logits: torch.Tensor


@dataclass
class ModelRunnerOutput:
    """One step's result, in the order the scheduler side applies it (the order it happened)."""

    # The persistent batch took the step's update: its joining requests are rows now.
    batch_updated: bool = False
    # Failed before the forward: a batch update, or a processor's update_state (isolated).
    batch_failures: list[Failure] = field(default_factory=list)
    # Chunks the forward computed (their KV is written); empty when none ran or it failed.
    computed: list[ScheduledChunk] = field(default_factory=list)
    # The forward failed: these requests end with this error.
    forward_failure: Failure | None = None
    # Failed while sampling: a processor's apply (isolated), or the sampler itself.
    sample_failures: list[Failure] = field(default_factory=list)
    sampled: SampledRows | None = None
    prompt_logits: PromptLogits | None = None


@dataclass
class LaunchedStep:
    """A step whose forward is launched (``Executor.launch``): the rows to sample from ``logits``."""

    out: ModelRunnerOutput
    rows: list[ScheduledChunk] = field(default_factory=list)
    logits: torch.Tensor | None = None


class ExecutorError(Exception):
    """A step broke past what the executor isolates; ``partial`` holds the failures it had handed
    out before (the scheduler side finishes them first, as they happened)."""

    def __init__(self, partial: ModelRunnerOutput, cause: Exception) -> None:
        super().__init__(str(cause))
        self.partial = partial
        self.cause = cause


def phase_error(phase: str, exc: BaseException) -> str:
    """The error text of a request failed in ``phase`` of a step."""
    return f"engine step failed in {phase}: {type(exc).__name__}: {exc}"

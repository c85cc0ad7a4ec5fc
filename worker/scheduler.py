"""Admission and token budgeting: which sequences run this step, and how many tokens each.

Decode rows come first (one token each), then partially prefilled prompts continue, then
waiting requests are admitted while there are free rows, KV slots and token budget. A prompt is
prefilled in chunks under the step's token budget, mixed into the same forward as the decode
rows; it joins the persistent batch (and is sampled) in the step that computes its last chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    token_ids: list[int]
    start_pos: int
    # True when this chunk's last position is sampled (decode, or the prompt's last chunk).
    sample: bool


@dataclass
class SchedulerOutput:
    # Sequences that left the persistent batch since the last step (finished or aborted).
    finished_ids: list[str] = field(default_factory=list)
    # Sequences that join the persistent batch this step (their prefill completes now).
    joining: list[Request] = field(default_factory=list)
    # Every chunk to run, keyed by request id.
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks.values())


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        allocate_slot: Callable[[], int],
        free_slot: Callable[[int], None],
    ) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens: must be >= max_num_seqs ({max_num_seqs}) so every decode row fits, "
                f"got {max_num_batched_tokens}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._allocate_slot = allocate_slot
        self._free_slot = free_slot
        self.waiting: deque[Request] = deque()
        # Admitted sequences (own a KV slot), in admission order.
        self.running: list[Request] = []
        # In-batch sequences that finished since the last schedule(); removed at the next update.
        self._leaving: list[str] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, request: Request) -> None:
        """Release a sequence that just finished (any reason); it leaves the batch next step."""
        if request.slot is not None:
            self._free_slot(request.slot)
            request.slot = None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.in_batch:
            self._leaving.append(request.request_id)
            request.in_batch = False

    def forget_batch(self) -> None:
        """The persistent batch was rebuilt empty: nothing is left to remove from it."""
        self._leaving = []

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._leaving)
        self._leaving = []
        budget = self.max_num_batched_tokens
        for req in self.running:
            if req.prefill_done:
                out.chunks[req.request_id] = ScheduledChunk(
                    req, [req.output_token_ids[-1]], req.num_computed_tokens, sample=True
                )
                budget -= 1
        for req in self.running:
            if budget <= 0:
                break
            if not req.prefill_done:
                budget -= self._schedule_prefill(req, budget, out)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            req.slot = self._allocate_slot()
            self.running.append(req)
            budget -= self._schedule_prefill(req, budget, out)
        return out

    def _schedule_prefill(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        start = req.num_computed_tokens
        n = min(req.prompt_len - start, budget)
        last = start + n == req.prompt_len
        out.chunks[req.request_id] = ScheduledChunk(req, req.prompt_token_ids[start : start + n], start, sample=last)
        if last:
            out.joining.append(req)
        return n

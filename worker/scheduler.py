"""Admission, token budgeting and preemption, decided from free KV blocks.

Decode rows come first (one token each), then partially prefilled (or resumed) sequences
continue, then waiting requests are admitted while there are free rows, token budget and KV
blocks for their next chunk. A new request first takes the longest cached prefix of its tokens
(prefix caching) and prefills only the rest, in chunks mixed into the same forward as the decode
rows; it joins the persistent batch (and is sampled) in the step that computes its last chunk.

When a running sequence needs a block and none is free, the most recently admitted sequences
are preempted by recomputation: their blocks are freed, they leave the persistent batch (the
processors see the removal) and go back to the front of the queue; on resumption they prefill
prompt + output so far and rejoin the batch with the same live output list.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from worker.kv.manager import KVCacheManager
from worker.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    token_ids: list[int]
    start_pos: int
    # True when this chunk's last position is sampled (decode, or the last chunk of a prefill).
    sample: bool


@dataclass
class SchedulerOutput:
    # Sequences that left the persistent batch since the last step (finished, aborted, preempted).
    finished_ids: list[str] = field(default_factory=list)
    # Sequences that join the persistent batch this step (their prefill completes now).
    joining: list[Request] = field(default_factory=list)
    # Every chunk to run, keyed by request id.
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)
    # Sequences preempted while building this step.
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks.values())


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, kv: KVCacheManager) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens: must be >= max_num_seqs ({max_num_seqs}) so every decode row fits, "
                f"got {max_num_batched_tokens}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.waiting: deque[Request] = deque()
        # Admitted sequences (own KV blocks), in admission order: preemption takes from the end.
        self.running: list[Request] = []
        # In-batch sequences that finished since the last schedule(); removed at the next update.
        self._leaving: list[str] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, request: Request) -> None:
        """Release a sequence that just finished (any reason); it leaves the batch next step."""
        if request.block_ids:
            self.kv.free(request)
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

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._leaving)
        self._leaving = []
        self._budget = self.max_num_batched_tokens
        for req in list(self.running):
            if req.in_batch and req in self.running and self._reserve(req, 1, out):
                self._put(out, req, 1)
        for req in list(self.running):
            if self._budget <= 0:
                break
            if not req.in_batch and req in self.running:
                n = min(req.num_pending_tokens, self._budget)
                if self._reserve(req, n, out):
                    self._put(out, req, n)
        while not out.preempted and self.waiting and self._budget > 0 and len(self.running) < self.max_num_seqs:
            if not self._admit(self.waiting[0], out):
                break
        return out

    def _admit(self, req: Request, out: SchedulerOutput) -> bool:
        """Admit the head of the queue if KV blocks allow its first chunk."""
        # Prompt logprobs need every prompt position's logits: no cached prefix (as vLLM).
        hits = [] if req.computes_prompt_logprobs else self.kv.computed_prefix(req)
        if not req.computes_prompt_logprobs and self._prefix_in_flight(req, len(hits)):
            return False
        cached = len(hits) * self.kv.block_size
        n = min(req.num_tokens - cached, self._budget)
        if not self.kv.allocate(req, n, hits):
            return False
        self.kv.record_lookup(req.num_tokens, cached)
        self.waiting.popleft()
        self.running.append(req)
        self._put(out, req, n)
        return True

    def _prefix_in_flight(self, req: Request, num_hits: int) -> bool:
        """True if a prefilling sequence is computing the block that would extend ``req``'s cache hit.

        Blocks are cached once computed, so admitting now would compute that shared prefix twice
        (n > 1 siblings, the same system prompt arriving together); waiting until the other
        prefill ends turns it into cache hits.
        """
        if not self.kv.enable_caching or num_hits >= len(req.block_hashes):
            return False
        nxt = req.block_hashes[num_hits]
        return any(
            not r.in_batch and r.num_registered_blocks <= num_hits < len(r.block_hashes)
            and r.block_hashes[num_hits] == nxt
            for r in self.running
        )

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Blocks for ``n`` more tokens of a running sequence, preempting the newest ones if needed.

        False when ``req`` itself had to be preempted (it was the newest left).
        """
        while not self.kv.allocate(req, n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        chunk = out.chunks.pop(req.request_id, None)
        if chunk is not None:
            self._budget += len(chunk.token_ids)
            if req in out.joining:
                out.joining.remove(req)
        if req.in_batch:
            out.finished_ids.append(req.request_id)
            req.in_batch = False
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _put(self, out: SchedulerOutput, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        last = start + n == req.num_tokens
        out.chunks[req.request_id] = ScheduledChunk(req, req.token_slice(start, start + n), start, sample=last)
        if last and not req.in_batch:
            out.joining.append(req)
        self._budget -= n

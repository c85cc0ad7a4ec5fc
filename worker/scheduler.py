"""Admission, token budgeting and preemption, decided from free KV blocks.

Decode rows come first (one token each), then partially prefilled (or resumed) sequences
continue, then waiting requests are admitted while there are free rows, token budget and KV
blocks for their next chunk. A new request first takes the longest cached prefix of its tokens
(prefix caching) and prefills only the rest, in chunks mixed into the same forward as the decode
rows; it joins the persistent batch (and is sampled) in the step that computes its last chunk.

When a running sequence needs a block and none is free, other sequences are preempted by
recomputation (the newest admitted, unless the policy says otherwise): their blocks are freed,
they leave the persistent batch (the processors see the removal) and go back to the front of
the queue; on resumption they prefill prompt + output so far and rejoin the batch with the same
live output list.

Which waiting sequence comes next, and which running one is preempted, is the policy's
(worker.fairness): by default fair between tenants and client requests, so one request holding
every row gives way to a newcomer within a step.

A sequence whose consumer is behind is paused: it leaves the batch but keeps its KV blocks (the
first to go when blocks run short) and rejoins, with no recompute, when resumed and a row is free.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from worker import fairness
from worker.config import SchedulingPolicy
from worker.fairness import Shares, WaitingQueue
from worker.kv.manager import KVCacheManager
from worker.request import PLACEHOLDER, Request


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    token_ids: list[int]
    start_pos: int
    # True when this chunk's last position is sampled (decode, or the last chunk of a prefill).
    sample: bool

    @property
    def fed(self) -> bool:
        """Its one token is still on the device (async scheduling): the runner feeds it there."""
        return self.token_ids[0] == PLACEHOLDER

    @property
    def prompt_positions(self) -> int:
        """How many leading positions give prompt logprobs (each predicts the next prompt token)."""
        req = self.request
        if not req.computes_prompt_logprobs:
            return 0
        return max(0, min(self.start_pos + len(self.token_ids), req.prompt_len - 1) - self.start_pos)


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
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv: KVCacheManager,
        policy: SchedulingPolicy = "fair",
        max_model_len: int = sys.maxsize,
    ) -> None:
        """The limits and policy of an `EngineConfig`, which validated them (``max_model_len``:
        the engine's, for rows whose token still on the device ends them by length)."""
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.policy = policy
        self.waiting = WaitingQueue()
        # Admitted sequences (own KV blocks, a batch row), in admission order.
        self.running: list[Request] = []
        # Paused sequences (out of the batch, KV kept unless evicted); resumed ones rejoin from here.
        self.paused: list[Request] = []
        self._resumed: list[Request] = []
        # In-batch sequences that finished since the last schedule(); removed at the next update.
        self._leaving: list[str] = []
        # Rows whose token still on the device ends them by length (async scheduling): out of the
        # batch and of ``running``, their blocks freed (``_retire``); they finish when it is read.
        self._retiring: list[Request] = []
        self._arrivals = 0
        self._shares: Shares | None = None  # the fair policy's, rebuilt by every schedule()
        self.num_preemptions = 0
        # Preemptions that gave a sequence below its fair share a row (worker.fairness).
        self.num_fair_preemptions = 0

    def add(self, request: Request) -> None:
        request.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Something to schedule (paused sequences alone are not: a step would do nothing)."""
        return bool(self.waiting or self.running or self._resumed or self._leaving)

    def finish(self, request: Request) -> None:
        """Release a sequence that just finished (any reason); it leaves the batch next step."""
        if request.block_ids:
            self.kv.free(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self._retiring:
            self._retiring.remove(request)
        elif request in self.paused:
            self.paused.remove(request)
            if request in self._resumed:
                self._resumed.remove(request)
        else:
            self.waiting.remove(request)
        request.paused = False
        self._leave_batch(request)

    def _leave_batch(self, request: Request) -> None:
        if request.in_batch:
            self._leaving.append(request.request_id)
            request.in_batch = False

    def pause(self, request: Request) -> None:
        """Hold ``request`` out of the batch (its consumer is behind); it keeps its KV blocks."""
        if request in self._resumed:  # resumed, then paused again before it rejoined
            self._resumed.remove(request)
            return
        if request.paused or request.finished:
            return
        if request in self.running:
            self.running.remove(request)
            self._leave_batch(request)
        elif not self.waiting.remove(request):
            return
        request.paused = True
        self.paused.append(request)

    def resume(self, request: Request) -> None:
        """Undo pause: with its KV it rejoins as soon as a row is free, without it it queues first."""
        if not request.paused or request in self._resumed:
            return
        if request.request_id in self._leaving:  # paused since the last step: its row never left
            self._leaving.remove(request.request_id)
            request.in_batch = True
            request.paused = False
            self.paused.remove(request)
            self.running.append(request)
            return
        if request.num_computed_tokens:
            self._resumed.append(request)
            return
        request.paused = False
        self.paused.remove(request)
        self.waiting.appendleft(request)

    def forget_batch(self, leaving: Iterable[str] = ()) -> None:
        """The persistent batch was rebuilt: of the removals pending, only ``leaving`` (rows of
        the rebuilt batch) are left to make."""
        self._leaving = list(leaving)

    # -- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._leaving)
        self._leaving = []
        self._budget = self.max_num_batched_tokens
        for req in list(self.running):  # first: they are gone, as finished rows are in a synchronous step
            if req.in_batch and req.num_placeholders and req.ends_by_length(self.max_model_len):
                self._retire(req, out)
        self._rejoin_resumed()
        shares = Shares.of(self.running, self.waiting, self.max_num_seqs) if self.policy == "fair" else None
        self._shares = shares
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
        if not out.preempted:  # blocks ran short for running sequences: admit nobody this step
            self._admit_waiting(out)
        return out

    def _retire(self, req: Request, out: SchedulerOutput) -> None:
        """Its token still on the device is its last: its row and its KV blocks go now, as a
        synchronous step's finished row's would (no step computes that token's KV); the request
        finishes when the token is read."""
        self.kv.free(req)
        self.running.remove(req)
        self._retiring.append(req)
        out.finished_ids.append(req.request_id)
        req.in_batch = False

    def _rejoin_resumed(self) -> None:
        """Resumed sequences that kept their KV take free rows first (they were admitted before)."""
        while self._resumed and len(self.running) < self.max_num_seqs:
            req = self._resumed.pop(0)
            self.paused.remove(req)
            req.paused = False
            if req.num_computed_tokens:
                self.running.append(req)
            else:  # evicted since it was resumed: recompute, first in the queue
                self.waiting.appendleft(req)

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        """Admit waiting sequences in the policy's order while rows, token budget and KV allow.

        fcfs / priority stop at the first sequence that does not fit (as vLLM); fair skips a
        group whose shared prefix is still being computed, and preempts for a sequence below its
        share (worker.fairness.fair_victim) rather than stop. A group preempted from is not
        admitted again in the same step (its rows are leaving the batch)."""
        blocked: set[fairness.GroupKey] = set()
        while self.waiting and self._budget > 0:
            req = fairness.pick(self.policy, self.waiting, self._shares, blocked)
            if req is None:
                return
            hits = self._cache_hits(req)
            if hits is None:
                if self.policy != "fair":
                    return
                blocked.add(fairness.group_key(req))
            elif len(self.running) >= self.max_num_seqs:
                if not self._preempt_for(req, out, blocked):
                    return
            elif not self._admit(req, hits, out) and not (self._evict_paused() or self._preempt_for(req, out, blocked)):
                return

    def _preempt_for(self, req: Request, out: SchedulerOutput, blocked: set[fairness.GroupKey]) -> bool:
        """Fair policy: preempt one sequence over its share for ``req`` (below its own)."""
        if self._shares is None:
            return False
        victim = fairness.fair_victim(req, self.running, self._shares)
        if victim is None:
            return False
        self._preempt(victim, out)
        blocked.add(fairness.group_key(victim))
        self.num_fair_preemptions += 1
        return True

    def _evict_paused(self) -> bool:
        """Free the KV of the longest-paused sequence still holding some; False if none does."""
        for req in self.paused:
            if req.block_ids:
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.num_preemptions += 1
                self.num_preemptions += 1
                return True
        return False

    def _cache_hits(self, req: Request) -> list[int] | None:
        """The cached blocks ``req`` may start from; None while another sequence is computing the
        next block of its prefix (see _prefix_in_flight)."""
        # Prompt logprobs need every prompt position's logits: no cached prefix (as vLLM).
        if req.computes_prompt_logprobs:
            return []
        hits = self.kv.computed_prefix(req)
        return None if self._prefix_in_flight(req, len(hits)) else hits

    def _admit(self, req: Request, hits: list[int], out: SchedulerOutput) -> bool:
        """Admit ``req`` (the head of its group) if KV blocks allow its first chunk."""
        cached = len(hits) * self.kv.block_size
        n = min(req.num_tokens - cached, self._budget)
        if not self.kv.allocate(req, n, hits):
            return False
        self.kv.record_lookup(req.num_tokens, cached)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
        self.waiting.remove(req)
        self.running.append(req)
        if self._shares is not None:
            self._shares.add(req)
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
            not r.in_batch
            and r.num_registered_blocks <= num_hits < len(r.block_hashes)
            and r.block_hashes[num_hits] == nxt
            for r in self.running
        )

    def _reserve(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Blocks for ``n`` more tokens of a running sequence, preempting the newest ones if needed.

        False when ``req`` itself had to be preempted (it was the newest left).
        """
        while not self.kv.allocate(req, n):
            if self._evict_paused():
                continue
            victim = fairness.kv_victim(self.policy, self.running, self._shares)
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        if self._shares is not None:
            self._shares.add(req, -1)
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
        if req.num_placeholders and not (n == 1 and req.in_batch):
            # Only a batch row's next token may still be on the device (the runner feeds it there).
            raise RuntimeError(f"{req.request_id}: {n} tokens scheduled while {req.num_placeholders} are unread")
        start = req.num_computed_tokens
        last = start + n == req.num_tokens
        out.chunks[req.request_id] = ScheduledChunk(req, req.token_slice(start, start + n), start, sample=last)
        if last and not req.in_batch:
            out.joining.append(req)
        self._budget -= n

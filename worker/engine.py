"""LLMEngine: the continuous-batching loop a worker runs, and its scheduler side.

One ``step()`` is three verbs: schedule (admission, KV bookkeeping) → execute (the
``worker.executor``: persistent-batch update, every processor's ``update_state``, one forward over
all rows, sampler) → update from the output (fail what the executor failed, append tokens to the
live output lists, detect finished sequences, hand out deltas). ``add_request`` /
``abort_request`` may be called from another thread: they go through an inbox the step drains
first, so the step thread alone touches engine state.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from worker.batch import PersistentBatch, seeded_generator
from worker.config import EngineConfig, resolve_async_scheduling
from worker.detokenizer import IncrementalDetokenizer, rust_tokenizer
from worker.executor.executor import Executor
from worker.executor.output import (
    ExecutorError,
    Failure,
    LaunchedStep,
    ModelRunnerOutput,
    PendingRows,
    SampledRows,
    phase_error,
)
from worker.executor.tensor_parallel import TensorParallelGroup, step_capacity
from worker.kv.manager import KVCacheManager
from worker.logits_processor.registry import LogitsProcessors
from worker.model.loader import LoadedModel, load_model, resolve_device, resolve_max_model_len
from worker.model.memory import CudaMemory, DeviceMemory, KVBudget, MemorySnapshot, RankMemory, cuda_memory
from worker.model.profile import kv_size
from worker.model.runner import ModelRunner
from worker.ops.host_sync import as_lists, host_lists
from worker.ops.prompt_logprobs import prompt_logprobs_topk
from worker.ops.staging import stage
from worker.outputs import CompletionOutput, FinishReason, Logprob, PositionLogprobs, RequestOutput, wire_logprob
from worker.request import Request, Scheduling
from worker.sampler import NO_FINITE_LOGIT, Sampler, SamplerOutput
from worker.sampling_params import SamplingParams
from worker.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from worker.validation import Prompt, RequestValidator

logger = logging.getLogger(__name__)


@dataclass
class _Parent:
    """The user's request: one prompt, ``n`` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    dirty: set[int] = field(default_factory=set)
    # Prompt logprobs (params.prompt_logprobs set): filled by position as child 0 prefills, so a
    # recomputed chunk overwrites rather than duplicates; sent once, with the first output.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_missing: int = 0
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    @property
    def awaiting_prompt_logprobs(self) -> bool:
        """Outputs wait for the prompt logprobs, unless the sequence computing them has ended."""
        return self.prompt_logprobs_missing > 0 and not self.children[0].finished


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are not read yet (async scheduling)."""

    out: ModelRunnerOutput
    rows: PendingRows | None  # None: nothing sampled (prompt chunks only)
    dropped: frozenset[str] = frozenset()  # rows done again next step: their tokens here are not kept


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: LoadedModel | None = None,
        memory: DeviceMemory | None = None,
        rank_memory: RankMemory = cuda_memory,
    ) -> None:
        """``memory``: the device's memory figures for KV sizing (default: CUDA's, on a GPU);
        ``rank_memory``: each tensor-parallel rank's (only tests give other figures than CUDA's).

        The model is ``loaded``, else ``config.model`` (``worker.model.loader.embedded_model_path``
        gives the embedded tiny one): the engine builds none itself.
        """
        if loaded is None and config.model is None:
            raise ValueError("model: the engine needs a model (a local path or hub id)")
        if loaded is not None and config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size: every rank loads its shard from config.model; pass no loaded model")
        self.config = config
        device = loaded.device if loaded is not None else resolve_device(config.device)
        if config.kv_cache_bytes is not None or config.tensor_parallel_size > 1:
            memory = None  # the pool's size is given (or, sharded, each rank measures its own device)
        elif memory is None and device.type == "cuda":
            memory = CudaMemory(device)
        start = memory.snapshot() if memory is not None else None  # before the weights load
        group = TensorParallelGroup(config, rank_memory) if config.tensor_parallel_size > 1 else None
        if group is not None:
            loaded = group.loaded  # rank 0's shard; the other ranks hold theirs
        elif loaded is None:
            assert config.model is not None
            loaded = load_model(config.model, device=device, dtype=config.dtype)
        try:
            self._start(config, self._runner(config, loaded, memory, start, group), sharded=group is not None)
        except BaseException:  # the ranks already started must not outlive a failed start
            if group is not None:
                group.close()
            raise
        self._init_state()

    def _start(self, config: EngineConfig, runner: ModelRunner, *, sharded: bool) -> None:
        """The KV pool's bookkeeping, the scheduler and the executor around ``runner``."""
        self.kv = KVCacheManager(runner.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching)
        logger.info(
            "KV storage: %d blocks x %d tokens = %d tokens, %.1f MiB%s; prefix caching %s",
            runner.num_blocks,
            config.block_size,
            self.kv.capacity_tokens,
            runner.kv_cache_bytes / 2**20,
            f" per rank of {config.tensor_parallel_size}" if sharded else "",
            "on" if config.enable_prefix_caching else "off",
        )
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv=self.kv,
            policy=config.scheduling_policy,
            max_model_len=self.max_model_len,
        )
        self.executor = Executor(config, runner, self.device, self.generator)
        self.async_scheduling = resolve_async_scheduling(config, self.device)
        self._refresh_validator()

    def _runner(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        memory: DeviceMemory | None,
        start: MemorySnapshot | None,
        group: TensorParallelGroup | None,
    ) -> ModelRunner:
        """The model's facts, the KV pool's size, and the runner (rank 0's, for a group)."""
        self.loaded = loaded
        self.device = loaded.device
        self.tokenizer = loaded.tokenizer
        self._backend = rust_tokenizer(loaded.tokenizer)
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        self.max_model_len = resolve_max_model_len(config.max_model_len, loaded.max_model_len)
        self.pin_memory = self.device.type == "cuda"
        if group is not None:
            capacity = step_capacity(config, self.max_model_len)
            runner = group.runner(config, max_model_len=self.max_model_len, capacity=capacity)
            # How rank 0's pool was sized on a GPU (None: kv_cache_bytes, or as on CPU).
            self.kv_budget: KVBudget | None = group.kv.budget
            return runner
        size = kv_size(loaded, config, self.max_model_len, memory, start)
        self.kv_budget = size.budget
        return ModelRunner.for_config(loaded, config, num_blocks=size.num_blocks, max_model_len=self.max_model_len)

    def _init_state(self) -> None:
        self._parents: dict[str, _Parent] = {}
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        # Requests answered without admission (duplicate ids), handed out with the next outputs.
        self._rejected: list[RequestOutput] = []
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        # Async scheduling: the step launched but not read yet; rows the next step does again.
        self._in_flight: _InFlight | None = None
        self._redo_ids: set[str] = set()
        self.num_redone_rows = 0  # rows a step was fed a token the exact pass then changed
        self.num_steps = 0
        # Terminal outcomes of sequences, by finish reason; batch-state rebuilds after a failure.
        self.finish_counts: collections.Counter[str] = collections.Counter()
        self.num_restarts = 0

    def _build_batch_state(self) -> None:
        """Fresh persistent batch, processors and sampler (after a failure no phase owns)."""
        self.executor.reset()
        self._refresh_validator()

    def _refresh_validator(self) -> None:
        """Validation runs the processors' ``validate_params``: the executor's current ones."""
        self.validator = RequestValidator(
            self.tokenizer, self.vocab_size, self.max_model_len, self.config.max_logprobs, self.executor.processors
        )

    # -- the executor's parts, as the engine's callers (metrics, tests, benches) read them ----

    @property
    def runner(self) -> ModelRunner:
        return self.executor.runner

    @property
    def batch(self) -> PersistentBatch:
        return self.executor.batch

    @property
    def processors(self) -> LogitsProcessors:
        return self.executor.processors

    @property
    def sampler(self) -> Sampler:
        return self.executor.sampler

    @property
    def num_condense_moves(self) -> int:
        return self.executor.num_condense_moves

    @property
    def num_swaps(self) -> int:
        return self.executor.num_swaps

    def close(self) -> None:
        """Release the executor's processes (a tensor-parallel group's ranks; nothing for one)."""
        self.executor.close()

    # -- requests in -------------------------------------------------------------------

    def validate(self, params: SamplingParams) -> SamplingParams:
        """Standard validation plus every loaded processor's ``validate_params`` (ValueError);
        returns the params to run (RequestValidator.validate)."""
        return self.validator.validate(params)

    def prepare(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams, scheduling: Scheduling | None = None
    ) -> _Parent:
        """Validate and build a request without admitting it (so a batch can be checked first).

        ``scheduling``: its group, tenant and priority for fair admission (default: a group of its own).
        """
        params = self.validate(params)
        scheduling = scheduling or Scheduling()
        self._check_scheduling(scheduling)
        ids = self.validator.tokenize(prompt)
        need = min(len(ids) + params.max_tokens, self.max_model_len)
        if need > self.kv.capacity_tokens:
            raise ValueError(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {need} tokens "
                f"of KV cache, more than the whole pool ({self.kv.capacity_tokens} tokens)"
            )
        request_id = request_id or uuid.uuid4().hex
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = _child_params(params, i)
            child_params.update_from_tokenizer(self.tokenizer, self.eos_token_ids)
            # Engine-side ids are never reused: a finished sequence stays in the persistent batch
            # until the next step's update, while its user id may already be taken again.
            child_id = f"{request_id}#{i}.{next(self._seq_ids)}"
            detok = IncrementalDetokenizer(
                self._backend, ids, stop=child_params.stop, skip_special_tokens=child_params.skip_special_tokens
            )
            child = Request(
                child_id,
                request_id,
                i,
                ids,
                child_params,
                detok,
                group=scheduling.group or request_id,
                tenant=scheduling.tenant,
                priority=scheduling.priority,
            )
            if child_params.seed is not None:
                child.generator = seeded_generator(child_params.seed, self.device)
            children.append(child)
        parent = _Parent(request_id, prompt if isinstance(prompt, str) else None, ids, children)
        if params.prompt_logprobs is not None:
            # Computed once, by child 0, and shared by every child (n > 1).
            parent.prompt_logprobs = [None] * len(ids)
            parent.prompt_logprobs_missing = len(ids) - 1
            children[0].computes_prompt_logprobs = len(ids) > 1
        return parent

    def _check_scheduling(self, scheduling: Scheduling) -> None:
        p = scheduling.priority
        if not isinstance(p, int) or isinstance(p, bool):
            raise ValueError(f"priority: must be an integer, got {p!r}")
        if p != 0 and self.config.scheduling_policy == "fcfs":
            raise ValueError(f"priority: got {p} but the engine's scheduling_policy is fcfs (use fair or priority)")
        if not isinstance(scheduling.group, str) or not isinstance(scheduling.tenant, str):
            raise ValueError("scheduling: group and tenant must be strings")

    def add_prepared(self, parent: _Parent) -> None:
        self._inbox.put(("add", parent))

    def add_request(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams, scheduling: Scheduling | None = None
    ) -> str:
        parent = self.prepare(request_id, prompt, params, scheduling)
        self.add_prepared(parent)
        return parent.request_id

    def abort_request(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def pause_request(self, request_id: str) -> None:
        """Stop stepping a request (its consumer is behind): its sequences leave the batch and keep
        their KV until blocks run short; ``resume_request`` brings them back."""
        self._inbox.put(("pause", request_id))

    def resume_request(self, request_id: str) -> None:
        self._inbox.put(("resume", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._parents) or not self._inbox.empty()

    def has_work(self) -> bool:
        """Whether a step would do anything: unfinished requests that are not all paused, or a
        step still to read (async scheduling)."""
        return self.scheduler.has_work() or not self._inbox.empty() or self._in_flight is not None

    @property
    def num_running(self) -> int:
        """Sequences admitted and not finished (decoding or prefilling).

        Not the batch size: a finished row stays in the persistent batch until the next step's
        update, and an idle engine takes no next step.
        """
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued for admission."""
        return len(self.scheduler.waiting)

    @property
    def num_paused(self) -> int:
        """Sequences held out of the batch because their consumer is behind."""
        return len(self.scheduler.paused)

    def kv_stats(self) -> dict[str, float]:
        """KV pool and prefix-cache counters for /metrics (blocks, hit rate, preemptions; those
        that gave a sequence below its fair share a row, worker.fairness)."""
        return {
            **self.kv.stats(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_fair_preemptions": self.scheduler.num_fair_preemptions,
        }

    def batch_request_ids(self) -> list[str]:
        """The user request id of every row of the persistent batch, in row order."""
        return [rid.rsplit("#", 1)[0] for rid in self.batch.req_ids]

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                assert isinstance(item, _Parent)
                if item.request_id in self._parents:
                    # Never admitted, but answered: a caller waiting on it must not hang.
                    for child in item.children:
                        child.finish(FinishReason.ERROR, error=f"duplicate request id {item.request_id!r}")
                    self._rejected.append(
                        RequestOutput(
                            item.request_id,
                            item.prompt,
                            item.prompt_token_ids,
                            [self._delta(c) for c in item.children],
                            True,
                        )
                    )
                    continue
                self._parents[item.request_id] = item
                for child in item.children:
                    self._requests[child.request_id] = child
                    self.scheduler.add(child)
            elif kind == "abort":
                parent = self._parents.get(str(item))
                for child in parent.children if parent else ():
                    self._finish(child, FinishReason.ABORT)
            else:  # pause / resume
                parent = self._parents.get(str(item))
                act = self.scheduler.pause if kind == "pause" else self.scheduler.resume
                for child in parent.children if parent else ():
                    if not child.finished:
                        act(child)

    # -- the step ------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return one delta RequestOutput per request that changed.

        A failure in any phase fails the requests it came from (``error``) and the engine keeps
        stepping (see "failure isolation" below). Only when even rebuilding the batch state
        fails does ``step`` raise: the engine cannot continue.
        """
        try:
            return self._step()
        except Exception as exc:  # noqa: BLE001 - not attributable to any phase: fail everyone, start clean
            self._fail_everything(exc)
            return self._collect_outputs()

    def _step(self) -> list[RequestOutput]:
        self._drain_inbox()
        if self.async_scheduling:
            return self._step_overlapped()
        sched = self._schedule()
        if sched is not None:
            self._update_from_output(sched, self._execute(sched))
        return self._collect_outputs()

    def _step_overlapped(self) -> list[RequestOutput]:
        """Async scheduling: step t+1 is scheduled and launched before step t's tokens are read.

        A row whose token is still on the device is scheduled with a placeholder that the runner
        feeds from the device; a row finishing with that token is computed once more, and its
        extra token dropped. Processors see what they see in a synchronous step: step t is read
        (tokens appended) before step t+1's sampler runs their ``apply``. A top-k / top-p row
        whose token the exact pass after the read changed was fed the first draw: its step t+1
        is dropped and done again (``_redo``), so every token is the synchronous engine's.
        """
        sched = self._schedule()
        step = self._launch(sched) if sched is not None else None
        if self._in_flight is not None:
            self._read_in_flight(step)
        if step is not None:
            self._start_sampling(step)
        return self._collect_outputs()

    def _launch(self, sched: SchedulerOutput) -> LaunchedStep:
        last = self._in_flight.rows if self._in_flight is not None else None
        try:
            step = self.executor.launch(sched, last)
        except ExecutorError as exc:
            self._update_from_launch(sched, exc.partial)
            raise exc.cause from exc
        self._update_from_launch(sched, step.out)
        return step

    def _start_sampling(self, step: LaunchedStep) -> None:
        redo, self._redo_ids = self._redo_ids, set()
        # A row done again must draw what it would have: its generator as before this call.
        redone = [c.request.generator for c in step.rows if c.request.request_id in redo]
        states = [(gen, gen.get_state()) for gen in redone if gen is not None]
        try:
            pending = self.executor.start_sampling(step)
        except ExecutorError as exc:
            self._apply_failures(exc.partial.sample_failures)
            raise exc.cause from exc
        finally:
            for gen, state in states:
                gen.set_state(state)
        self._apply_failures(step.out.sample_failures)  # now: a rebuilt batch is the next step's
        step.out.sample_failures.clear()
        if pending is None and step.out.prompt_logits is None:
            return  # nothing was sampled or computed that is still to read
        for c in pending.rows if pending is not None else ():
            if c.request.request_id not in redo:
                c.request.num_placeholders += 1
        self._in_flight = _InFlight(step.out, pending, frozenset(redo))

    def _read_in_flight(self, launched: LaunchedStep | None) -> None:
        """Read the step in flight; ``launched``: the step just launched from its tokens."""
        flight, self._in_flight = self._in_flight, None
        assert flight is not None
        out, sampled = flight.out, None
        if flight.rows is not None:
            for c in flight.rows.rows:
                if c.request.request_id not in flight.dropped:
                    c.request.num_placeholders -= 1
            sampled = self.executor.finish_sampling(flight.rows, out.sample_failures)
        if sampled is not None and sampled.output.redrawn and launched is not None:
            self._redo(sampled, launched)
        self._update_from_samples(out, sampled, skip=flight.dropped)
        for c in sampled.rows if sampled is not None else ():
            self.kv.register_full_blocks(c.request)  # blocks whose last token was on the device

    def _redo(self, sampled: SampledRows, launched: LaunchedStep) -> None:
        """Rows ``launched`` was fed a token the exact pass then changed: their KV at that position
        is computed again next step, and what ``launched`` samples for them is dropped."""
        fed = {c.request.request_id for c in launched.rows if c.fed}
        for row in sampled.output.redrawn:
            req = sampled.rows[row].request
            if req.request_id in fed:
                req.num_computed_tokens -= 1
                self._redo_ids.add(req.request_id)
                self.num_redone_rows += 1

    def _schedule(self) -> SchedulerOutput | None:
        try:
            return self.scheduler.schedule()
        except Exception as exc:  # noqa: BLE001 - a scheduler failure fails everyone, the engine goes on
            self._fail_everything(exc, phase="schedule")
            return None

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The executor's step; when it breaks past its own isolation, what it had failed is
        applied first, then the step fails as a whole (``step``)."""
        try:
            return self.executor.execute_model(sched)
        except ExecutorError as exc:
            self._update_from_output(sched, exc.partial)
            raise exc.cause from exc

    def _update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Apply the executor's step, in the order it happened: joined rows, failures, KV written,
        sampled tokens, prompt logprobs."""
        self._update_from_launch(sched, out)
        self._update_from_samples(out, out.sampled)

    def _update_from_launch(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """The step's batch update and forward: joined rows, their failures, KV written."""
        if out.batch_updated:
            now = time.monotonic()
            for req in sched.joining:
                req.in_batch = True
                if req.queue_time_s is None:  # the first time only: a preempted one rejoins later
                    req.queue_time_s = now - req.queued_at
        self._apply_failures(out.batch_failures)
        if out.forward_failure is not None:
            self._apply_failures([out.forward_failure])
        for c in out.computed:
            c.request.num_computed_tokens = c.start_pos + len(c.token_ids)
            self.kv.register_full_blocks(c.request)
        if out.computed:
            self.num_steps += 1

    def _update_from_samples(
        self, out: ModelRunnerOutput, sampled: SampledRows | None, skip: frozenset[str] = frozenset()
    ) -> None:
        """The step's sampler and what the forward gave besides: failures, tokens (but ``skip``'s:
        rows done again), prompt logprobs."""
        self._apply_failures(out.sample_failures)
        if sampled is not None:
            self._append_samples(sampled.rows, sampled.output, skip)
        if out.prompt_logits is not None:
            self._record_prompt_logprobs(out.prompt_logits.chunks, out.prompt_logits.logits)

    def _apply_failures(self, failures: Iterable[Failure]) -> None:
        for failure in failures:
            for req in failure.requests:
                self._finish(req, FinishReason.ERROR, error=failure.error)
            if failure.rebuilt:  # the executor rebuilt its batch: only its rows can still leave it
                # (async scheduling: rows that finished when the last step was read)
                self.scheduler.forget_batch(r.request_id for r in self.executor.batch_requests() if not r.in_batch)
                self._refresh_validator()
                self.num_restarts += 1

    def _record_prompt_logprobs(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> None:
        """Fill the parents' prompt logprobs from the extra logits rows (``prompt_positions`` per chunk)."""
        counts = [c.prompt_positions for c in chunks]
        offset = 0
        for chunk, m in zip(chunks, counts):
            if not m:
                continue
            req = chunk.request
            try:
                self._fill_prompt_logprobs(self._parents[req.parent_id], chunk.start_pos, logits[offset : offset + m])
            except Exception as exc:  # noqa: BLE001 - this request alone ends
                self._finish(req, FinishReason.ERROR, error=phase_error("prompt logprobs", exc))
            offset += m

    def _fill_prompt_logprobs(self, parent: _Parent, start: int, logits: torch.Tensor) -> None:
        """Logits at positions start.. predict prompt tokens start+1..; each position is stored once."""
        assert parent.prompt_logprobs is not None
        k = parent.children[0].params.prompt_logprobs or 0
        targets = parent.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
        dev = logits.device
        target_ids = stage(targets, torch.int64, dev, pin=dev.type == "cuda")
        ids, vals, ranks = host_lists(*prompt_logprobs_topk(logits, target_ids, k), label="prompt logprobs")
        # Each distinct token decoded once, in one call: per-token decodes dominated the cost.
        distinct = sorted({t for row in ids for t in row})
        names = dict(zip(distinct, self._backend.decode_batch([[t] for t in distinct], skip_special_tokens=False)))
        for j, (row_ids, row_vals, rank) in enumerate(zip(ids, vals, ranks)):
            pos = start + 1 + j
            if parent.prompt_logprobs[pos] is None:
                parent.prompt_logprobs_missing -= 1
            parent.prompt_logprobs[pos] = self._position_logprobs(len(row_ids) - 1, row_ids, row_vals, rank, names)
        if parent.prompt_logprobs_missing == 0:
            parent.children[0].computes_prompt_logprobs = False

    def _append_samples(self, rows: list[ScheduledChunk], out: SamplerOutput, skip: frozenset[str]) -> None:
        # The sampler's output is on the host already (its one read of the step): lists, no read.
        tokens, errors = as_lists(out.sampled_token_ids, out.errors)
        lp = out.logprobs
        lp_lists = as_lists(lp.token_ids, lp.logprobs, lp.ranks) if lp is not None else None
        for row, chunk in enumerate(rows):
            req = chunk.request
            if req.finished or req.request_id in skip:  # async scheduling: ended while it ran, or redone
                continue
            if errors[row]:
                self._finish(req, FinishReason.ERROR, error=out.error_messages.get(row, NO_FINITE_LOGIT))
                continue
            try:
                tok = tokens[row]
                req.output_token_ids.append(tok)
                req.new_token_ids.append(tok)
                if req.logprobs is not None and lp_lists is not None:
                    lp_ids, lp_vals, lp_ranks = lp_lists
                    position = self._position_logprobs(
                        req.params.logprobs or 0, lp_ids[row], lp_vals[row], lp_ranks[row]
                    )
                    req.logprobs.append(position)
                    req.new_logprobs.append(position)
                    req.cumulative_logprob = (req.cumulative_logprob or 0.0) + position[tok].logprob
                self._check_stop(req, tok)
            except Exception as exc:  # noqa: BLE001 - detokenizer / stop check of this one row
                self._finish(req, FinishReason.ERROR, error=phase_error("token append (detokenize, stop check)", exc))
            self._parents[req.parent_id].dirty.add(req.index)

    def _position_logprobs(
        self, k: int, ids: list[int], vals: list[float], sampled_rank: int, names: dict[int, str] | None = None
    ) -> PositionLogprobs:
        """``names``: the decoded text of every token in ``ids``, when already known."""

        def decode(tok: int) -> str:
            return names[tok] if names is not None else self._backend.decode([tok], skip_special_tokens=False)

        position: PositionLogprobs = {ids[0]: Logprob(wire_logprob(vals[0]), sampled_rank, decode(ids[0]))}
        for i in range(1, k + 1):
            if ids[i] not in position:
                position[ids[i]] = Logprob(wire_logprob(vals[i]), i, decode(ids[i]))
        return position

    def _check_stop(self, req: Request, tok: int) -> None:
        p = req.params
        n_out = len(req.output_token_ids)
        past_min = n_out >= p.min_tokens
        if past_min and tok in p.all_stop_token_ids:
            # The stop token (EOS or a stop_token_ids one) stays in token_ids but not in the
            # text, as vLLM: its text (`<|eos|>` with skip_special_tokens off) is no answer.
            self._finish(req, FinishReason.STOP, stop_reason=tok if tok in p.stop_token_ids else None)
            return
        stop_str = req.detokenizer.update(tok, check_stop=past_min)
        if stop_str is not None:
            self._finish(req, FinishReason.STOP, stop_reason=stop_str)
        elif req.ends_by_length(self.max_model_len):
            self._finish(req, FinishReason.LENGTH)

    def _finish(
        self, req: Request, reason: FinishReason, *, stop_reason: str | int | None = None, error: str | None = None
    ) -> None:
        if req.finished:
            return
        req.finish(reason, stop_reason=stop_reason, error=error)
        self.finish_counts[str(reason)] += 1
        self.scheduler.finish(req)
        self._parents[req.parent_id].dirty.add(req.index)

    # -- failure of a whole step ---------------------------------------------------------------

    def _rebuild(self) -> None:
        """The executor's batch state starts empty; the scheduler forgets the rows it held."""
        self.scheduler.forget_batch()
        self._build_batch_state()
        self.num_restarts += 1

    def _fail_everything(self, exc: Exception, phase: str = "step") -> None:
        """Last resort: every unfinished request ends with `error` and the engine starts clean.

        Raises (the engine cannot continue) only when rebuilding itself fails.
        """
        logger.exception("engine %s failed; failing every unfinished request", phase)
        error = phase_error(phase, exc)
        for parent in list(self._parents.values()):
            for child in parent.children:
                self._finish(child, FinishReason.ERROR, error=error)
        self._in_flight, self._redo_ids = None, set()  # their rows have just ended
        self._rebuild()

    # -- outputs out ---------------------------------------------------------------------

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs, self._rejected = self._rejected, []
        for parent in list(self._parents.values()):
            if not parent.dirty or parent.awaiting_prompt_logprobs:
                continue
            try:
                deltas = [self._delta(parent.children[i]) for i in sorted(parent.dirty)]
            except Exception as exc:  # noqa: BLE001 - this request's detokenizer broke: it alone ends
                deltas = self._error_deltas(parent, phase_error("output collection", exc))
            parent.dirty.clear()
            finished = parent.finished
            out = RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, deltas, finished)
            out.num_cached_tokens = min(
                (c.num_cached_tokens for c in parent.children if c.num_cached_tokens is not None), default=None
            )
            if parent.prompt_logprobs is not None and not parent.prompt_logprobs_sent:
                parent.prompt_logprobs_sent = True
                if parent.prompt_logprobs_missing == 0:
                    out.prompt_logprobs = parent.prompt_logprobs
            outputs.append(out)
            if finished:
                del self._parents[parent.request_id]
                for child in parent.children:
                    self._requests.pop(child.request_id, None)
        return outputs

    def _error_deltas(self, parent: _Parent, error: str) -> list[CompletionOutput]:
        """Final deltas of a request whose outputs could not be built (no text: it is what broke)."""
        for child in parent.children:
            self._finish(child, FinishReason.ERROR, error=error)
        parent.dirty.clear()
        return [
            CompletionOutput(
                c.index, "", c.new_token_ids, None, None, str(c.finish_reason), None, c.error, c.queue_time_s
            )
            for c in parent.children
        ]

    def _delta(self, req: Request) -> CompletionOutput:
        delta = CompletionOutput(
            index=req.index,
            text=req.detokenizer.take_delta(req.finished),
            token_ids=req.new_token_ids,
            cumulative_logprob=req.cumulative_logprob,
            logprobs=req.new_logprobs if req.logprobs is not None else None,
            finish_reason=str(req.finish_reason) if req.finish_reason else None,
            stop_reason=req.stop_reason,
            error=req.error,
            queue_time_s=req.queue_time_s if req.finished else None,
        )
        req.new_token_ids = []
        req.new_logprobs = []
        return delta


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n sequences: same params, n=1, and a distinct seed when seeded (as vLLM)."""
    seed = None
    if params.seed is not None:
        seed = params.seed + index
        if seed >= 2**64:  # stays in range; seed - 2**64 gives torch the same stream (seed % 2**64)
            seed -= 2**64
    return dataclasses.replace(params, n=1, seed=seed)

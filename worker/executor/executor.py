"""Executor: runs one scheduled step (batch update, processors, forward, sampler) on rank 0.

A processor that raises in ``update_state`` or ``apply`` fails only the rows that trigger it:
fresh instances of the processors replay the failing call over halves of the batch (bisection);
rows whose replay still fails are the culprits. The survivors are re-added to a rebuilt batch
state (fresh processors see them as ``added`` with their live output lists; seeded rows keep
their generators), so they continue exactly as if nothing had happened. Every failure is handed
back in ``ModelRunnerOutput`` for the scheduler side to finish, in the order it happened.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from worker.batch import PersistentBatch
from worker.config import EngineConfig
from worker.executor.output import (
    ExecutorError,
    Failure,
    LaunchedStep,
    ModelRunnerOutput,
    PendingRows,
    PromptLogits,
    SampledRows,
    phase_error,
)
from worker.logits_processor.errors import ProcessorError
from worker.logits_processor.interface import BatchUpdate
from worker.logits_processor.registry import LogitsProcessors, build_logits_processors
from worker.model.runner import ModelRunner, ScheduledSeq, TokenFeed
from worker.ops.staging import to_device
from worker.reorder import tail_swaps
from worker.request import Request
from worker.sampler import Sampler, SamplerOutput
from worker.scheduler import ScheduledChunk, SchedulerOutput

logger = logging.getLogger(__name__)


class Executor:
    """Owns the persistent batch, the processor registry, the sampler and the model runner."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, device: torch.device, generator: torch.Generator):
        """``runner``: one process's ``ModelRunner``, or rank 0 of a tensor-parallel group."""
        self.config = config
        self.runner = runner
        self.device = device
        self.pin_memory = device.type == "cuda"
        self.generator = generator
        self.num_condense_moves = 0
        self.num_swaps = 0
        self.reset()

    def reset(self) -> None:
        """Fresh persistent batch, processors and sampler (at start, and after a processor failed)."""
        self.processors: LogitsProcessors = build_logits_processors(
            self.config,
            self.device,
            self.pin_memory,
            custom=self.config.logits_processors,
            entry_points=self.config.load_entry_points,
        )
        self.batch = PersistentBatch(self.config.max_num_seqs, device=self.device, pin_memory=self.pin_memory)
        self.sampler = Sampler(self.processors, generator=self.generator)
        # The request of every row of the batch (and of rows leaving it at the next update).
        self._rows: dict[str, Request] = {}

    def close(self) -> None:
        """Release the model runner's processes (none for one process)."""
        self.runner.close()

    # -- the step ------------------------------------------------------------------------

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Update the batch, run the forward over every scheduled chunk, sample the batch rows."""
        step = self.launch(sched)
        try:
            if step.rows and step.logits is not None:
                sampled = self._sample(step.rows, step.logits[: len(step.rows)], step.out.sample_failures)
                step.out.sampled = sampled if isinstance(sampled, SampledRows) else None
        except Exception as exc:
            raise ExecutorError(step.out, exc) from exc
        return step.out

    # -- the step in two halves (async scheduling launches the next step between them) ----------

    def launch(self, sched: SchedulerOutput, last: PendingRows | None = None) -> LaunchedStep:
        """Update the batch and launch the forward over every scheduled chunk; ``last``: the step
        whose tokens are still on the device, which feeds the rows scheduled with a placeholder."""
        step = LaunchedStep(ModelRunnerOutput())
        try:
            if not self._update_batch(sched, step.out):
                return step
            step.rows = [sched.chunks[rid] for rid in self.batch.req_ids]
            partial = [c for c in sched.chunks.values() if not c.sample]
            step.logits = self._execute(step.rows, partial, step.out, last)
            if step.logits is not None and step.logits.shape[0] > len(step.rows):
                step.out.prompt_logits = PromptLogits(step.rows + partial, step.logits[len(step.rows) :])
        except Exception as exc:
            raise ExecutorError(step.out, exc) from exc
        return step

    def start_sampling(self, step: LaunchedStep) -> PendingRows | None:
        """The sampler's device work over the launched rows, processors included; no read. A
        processor failure is isolated as in ``execute_model`` (into ``step.out.sample_failures``)."""
        if not step.rows or step.logits is None:
            return None
        try:
            pending = self._sample(step.rows, step.logits[: len(step.rows)], step.out.sample_failures, defer=True)
        except Exception as exc:
            raise ExecutorError(step.out, exc) from exc
        return pending if isinstance(pending, PendingRows) else None

    @staticmethod
    def finish_sampling(pending: PendingRows, failures: list[Failure]) -> SampledRows | None:
        """The read of a started sampler call. The batch has moved on since (the next step was
        launched), so a failure here fails these rows and rebuilds nothing; and a NaN is not
        traced to a processor (their state is the next step's)."""
        try:
            return SampledRows(pending.rows, pending.sample.result(trace_nan=False))
        except Exception as exc:  # noqa: BLE001 - the read of these rows failed: they end, the batch goes on
            failures.append(Failure(tuple(c.request for c in pending.rows), phase_error("sampler", exc), False))
            return None

    def batch_requests(self) -> list[Request]:
        """The request of every row of the persistent batch, in row order."""
        return [self._rows[rid] for rid in self.batch.req_ids]

    def _update_batch(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> bool:
        """Persistent-batch update, then every processor's ``update_state``; False: skip the step."""
        for req in sched.joining:
            self._rows[req.request_id] = req
        joining = [(r.request_id, r.params, r.prompt_token_ids, r.output_token_ids, r.generator) for r in sched.joining]
        try:
            update = self.batch.update(sched.finished_ids, joining, swaps=self._swaps)
        except Exception as exc:  # noqa: BLE001 - a batch-update failure fails the batch, which is rebuilt
            in_batch = [self._rows[rid] for rid in self.batch.req_ids if rid in self._rows]
            self._fail_and_rebuild(in_batch + sched.joining, phase_error("batch update", exc), out.batch_failures)
            return False
        for rid in sched.finished_ids:
            self._rows.pop(rid, None)
        for req in sched.joining:  # a row now (the scheduler side marks it in_batch from batch_updated)
            self._rows[req.request_id] = req
        out.batch_updated = True
        if update is not None:
            self.num_condense_moves += sum(1 for m in update.moved if m[2].name == "UNIDIRECTIONAL")
            self.num_swaps += sum(1 for m in update.moved if m[2].name == "SWAP")
        try:
            self.processors.update_state(update)
        except ProcessorError as exc:
            self._isolate(exc, [self._rows[rid] for rid in self.batch.req_ids], None, out.batch_failures)
        return True

    def _swaps(self, order: list[str]) -> list[tuple[int, int]]:
        if not self.config.reorder_batch:
            return []
        return tail_swaps(order, lambda rid: self._rows[rid].remaining_tokens)

    def _execute(
        self,
        rows: list[ScheduledChunk],
        partial: list[ScheduledChunk],
        out: ModelRunnerOutput,
        last: PendingRows | None = None,
    ) -> torch.Tensor | None:
        """The forward over every scheduled chunk; on failure those requests end with `error`."""
        if not rows and not partial:
            return None
        chunks = rows + partial
        seqs = [
            ScheduledSeq(c.request.block_ids, c.token_ids, c.start_pos, c.sample, c.prompt_positions) for c in chunks
        ]
        try:
            logits = self.runner.execute(seqs, _feed(chunks, last))
        except Exception as exc:  # noqa: BLE001 - a failed forward fails its sequences, not the engine
            # Rows leave the batch by the normal removal next step: processor state stays valid.
            logger.warning("model forward failed: %r; failing its %d sequences", exc, len(seqs))
            out.forward_failure = Failure(tuple(c.request for c in chunks), phase_error("model forward", exc), False)
            return None
        out.computed = chunks
        return logits

    def _sample(
        self, rows: list[ScheduledChunk], logits: torch.Tensor, failures: list[Failure], *, defer: bool = False
    ) -> SampledRows | PendingRows | None:
        """The sampler over the batch rows (``defer``: its device work only, the read left to
        ``finish_sampling``). A processor failure is isolated to its rows and the others are
        sampled again from the untouched logits; None when no row is left."""
        # float32 logits are processed in place: keep them intact for the fault path.
        work = logits.clone() if logits.dtype == torch.float32 else logits
        while True:
            try:
                pending = self.sampler.start(work, self.batch.sampling_metadata(), pristine=logits)
                if defer:
                    return PendingRows(rows, pending)
                sampled: SamplerOutput = pending.result()
                return SampledRows(rows, sampled)
            except ProcessorError as exc:
                survivors = self._isolate(exc, [c.request for c in rows], logits, failures)
            except Exception as exc:  # noqa: BLE001 - a sampler failure fails these rows; the batch is rebuilt
                self._fail_and_rebuild([c.request for c in rows], phase_error("sampler", exc), failures)
                return None
            if not survivors:
                return None
            # Every round fails at least one row, so this ends.
            position = {c.request.request_id: i for i, c in enumerate(rows)}
            rows = [rows[position[r.request_id]] for r in survivors]
            logits = logits[to_device([position[r.request_id] for r in survivors], torch.int64, logits.device)]
            work = logits.clone()

    # -- failure isolation -------------------------------------------------------------------

    def _isolate(
        self, exc: ProcessorError, reqs: list[Request], logits: torch.Tensor | None, failures: list[Failure]
    ) -> list[Request]:
        """Fail the culprits of ``exc`` among ``reqs`` (batch rows in order); rebuild; return the survivors."""
        culprits = self._culprits(exc, reqs, logits)
        logger.warning("%s; failing %d of the %d requests of this step", exc, len(culprits), len(reqs))
        blamed = {id(r) for r in culprits}
        survivors = [r for r in reqs if id(r) not in blamed]
        return self._fail_and_rebuild(culprits, str(exc), failures, survivors)

    def _culprits(self, exc: ProcessorError, reqs: list[Request], logits: torch.Tensor | None) -> list[Request]:
        """The rows whose replay alone fails; every row when the failure cannot be pinned down."""

        def fails(part: list[int]) -> bool:
            return self._replay_fails(exc, [reqs[i] for i in part], None if logits is None else logits[part])

        def bisect(part: list[int]) -> list[int]:
            if not fails(part):
                return []
            if len(part) == 1:
                return part
            half = len(part) // 2
            return (bisect(part[:half]) + bisect(part[half:])) or part  # only together: blame them all

        try:
            rows = bisect(list(range(len(reqs))))
        except Exception:  # the replay itself broke: blame everyone
            logger.exception("replaying a processor failure failed")
            rows = []
        return [reqs[i] for i in rows] if rows else list(reqs)

    def _replay_fails(self, exc: ProcessorError, reqs: list[Request], logits: torch.Tensor | None) -> bool:
        """Does the failing call raise again on fresh processors holding only ``reqs``?"""
        procs = self.processors.fresh(self.config, self.device, self.pin_memory)
        try:
            procs.update_state(_added(reqs))
            if exc.phase == "apply" and logits is not None:
                x = logits.to(torch.float32, copy=True)
                for p in procs.every():
                    if type(p).__name__ == exc.processor:
                        x = p.apply(x)
        except Exception:  # noqa: BLE001 - any failure on replay means the processor fails on its own
            return True
        return False

    def _fail_and_rebuild(
        self, failed: Sequence[Request], error: str, failures: list[Failure], survivors: Sequence[Request] = ()
    ) -> list[Request]:
        """``failed`` end with `error`; fresh batch, processors and sampler hold only ``survivors``.

        Returns the survivors in the rebuilt batch, in row order.
        """
        failures.append(Failure(tuple(failed), error, True))
        self.reset()
        if not survivors:
            return []
        # Seeded survivors keep their own generators (held by the request), so their streams go on.
        rejoin = [(r.request_id, r.params, r.prompt_token_ids, r.output_token_ids, r.generator) for r in survivors]
        self._rows = {r.request_id: r for r in survivors}
        update = self.batch.update([], rejoin)
        try:
            self.processors.update_state(update)
        except ProcessorError as exc:  # another culprit among the survivors: isolate it too
            return self._isolate(exc, list(survivors), None, failures)
        return list(survivors)


def _feed(chunks: list[ScheduledChunk], last: PendingRows | None) -> TokenFeed | None:
    """Where the step's placeholder tokens come from: each is its row's token of ``last``."""
    seqs = [i for i, c in enumerate(chunks) if c.fed]
    if not seqs:
        return None
    if last is None:
        raise RuntimeError("a token scheduled as a placeholder has no step in flight to come from")
    row_of = last.row_of()
    return TokenFeed(last.sample.tokens, seqs, [row_of[chunks[i].request.request_id] for i in seqs])


def _added(reqs: list[Request]) -> BatchUpdate:
    """What fresh processors are told about ``reqs`` as rows 0..n-1 (their live output lists)."""
    added = [(i, r.params, r.prompt_token_ids, r.output_token_ids) for i, r in enumerate(reqs)]
    return BatchUpdate(batch_size=len(reqs), removed=[], moved=[], added=added)

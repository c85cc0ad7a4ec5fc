"""The batched sampler (docs/sampling.md "The nine steps"): one token per row of
``(logits, metadata)``; the order is the contract.

1 keep raw logprobs / logits for rows that ask (before anything writes the logits)
2 float32
3-5 every non-argmax-invariant processor in registry order (allowed ids, bad words, min-tokens,
  logit bias, custom ones); an exception becomes ``ProcessorError(name, "apply", exc)``
6 penalties, unless no row uses one
7 greedy rows: argmax now (lowest id wins a tie), before temperature
7a temperature, in place (greedy rows would divide by 1: they are skipped)
7b argmax-invariant processors (Min-P, ...) - not called at all when every row is greedy
7c top-k (exactly k, ties toward lower ids), then top-p (smallest prefix reaching p)
7d an exact inverse-CDF draw, one float64 uniform per row; seeded rows use their own generator
8 logprobs: top-K of the row's source, the sampled token's logprob and 1-based rank
9 return

One call's state lives in a ``_Call`` that each step method takes and fills in; the step's
large temporaries live in the named slots of ``_Scratch``. Kernels read a group's rows in place,
a run of consecutive rows at a time (``plan.Run``), rather than from a gathered copy.

Non-finite logits, row by row (``ops.non_finite``): the flags come from the block maxima after
step 6, which greedy argmax then reuses; when random rows follow, every row is rewritten on the
device, branch-free: a row holding ``+inf`` is forced, its ``+inf`` tokens become 0 and every
other token -inf, so greedy takes the lowest such id and a draw is uniform among them; a row
holding NaN fails. A row left with no finite logit (or NaN) gets ``errors[row] = True``, token -1
and a message in ``error_messages``; the others are not affected.

Host reads (docs/sampling.md "Host reads"): every one goes through ``ops.host_sync`` (issued
with ``start_to_host`` when step 8 is done, waited for by ``PendingSample.result``). In
the steady state the call reads ONCE: the tokens, the failure flags, the logprobs and the flags
of the rare rows in one transfer; ``SamplerOutput`` is on the host. The rare rows (a top-k draw
landing on a tie at the k-th place, a logprob top-K tie, processed logprobs modes, a top-p
nucleus that does not fit the probe) take an exact pass after that read, with the same
uniforms, and one more read (the histogram has its own besides). The plan is built from the
metadata's host columns, without a read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from worker.logits_processor.errors import ProcessorError
from worker.logits_processor.interface import LogitsProcessor
from worker.ops.blocks import block_reduce, block_size
from worker.ops.draw import draw_rows, draw_weights, row_block_sums, row_total, softmax_rows, uniforms
from worker.ops.host_sync import HostCopy, as_lists, host_lists, start_to_host
from worker.ops.logprobs import logprob_rows, sampled_logprob_and_rank, to_logprobs_
from worker.ops.non_finite import NonFinite, non_finite_rows, resolve_non_finite_
from worker.ops.plan import RowGroup, SamplingPlan, build_plan
from worker.ops.scratch import Buffer
from worker.ops.select import ambiguous, resolve_topk, row_argmax, sort_by_value_then_id, topk_candidates
from worker.ops.staging import to_device
from worker.ops.topk_topp import TopPScratch, top_p_histogram_, top_p_keep, top_p_probe
from worker.sampling_metadata import SamplingMetadata

_NEG_INF = float("-inf")


class ProcessorSet(Protocol):
    """What the sampler needs of the loaded processors (``registry.LogitsProcessors``); read-only
    properties, so that a set holding lists (or a penalties subclass) conforms."""

    @property
    def non_argmax_invariant(self) -> Sequence[LogitsProcessor]: ...
    @property
    def argmax_invariant(self) -> Sequence[LogitsProcessor]: ...
    @property
    def penalties(self) -> LogitsProcessor: ...


@dataclass(frozen=True)
class LogprobsTensors:
    """Per row: column 0 is the sampled token, columns 1..K the row's top-K (value desc, id asc).

    Rows that asked for fewer than K use their first columns; rows that asked for none hold
    id -1, logprob NaN and rank -1 (column 0 still holds the sampled token).
    """

    token_ids: torch.Tensor  # [B, K+1] int64
    logprobs: torch.Tensor  # [B, K+1] float32
    ranks: torch.Tensor  # [B] int64, rank of the sampled token: count(logprob >= sampled's)


NO_FINITE_LOGIT = (
    "no token has a finite logit after processing: every token was excluded (allowed_token_ids, "
    "bad_words, logit_bias and the logits processors excluded every token)"
)
NAN_LOGITS = "the logits held NaN"


@dataclass(frozen=True)
class SamplerOutput:
    """The call's result, on the host (CPU tensors, brought over in the call's one read)."""

    sampled_token_ids: torch.Tensor  # [B] int64; -1 where errors
    logprobs: LogprobsTensors | None
    errors: torch.Tensor  # [B] bool: the row had no finite logit left, or held NaN
    # Why error rows failed (host side): NaN and its source, or every token excluded. A failed row
    # missing here had every token excluded (NO_FINITE_LOGIT).
    error_messages: dict[int, str] = field(default_factory=dict)
    # Rows whose token the exact pass changed after the first read: ``PendingSample.tokens`` had
    # the first one (async scheduling fed it to the next step, which redoes those rows).
    redrawn: tuple[int, ...] = ()


class PendingSample:
    """A sampler call between its device work and its host read (``Sampler.start``)."""

    def __init__(
        self, sampler: Sampler, call: _Call, read: _PendingRead, pristine: torch.Tensor | None, md: SamplingMetadata
    ) -> None:
        self._sampler, self._call, self._read, self._pristine, self._md = sampler, call, read, pristine, md

    @property
    def tokens(self) -> torch.Tensor:
        """[B] int64 on the device, -1 on failed rows: the next step's inputs. The exact pass after
        the read may still change a top-k / top-p row's token (``SamplerOutput.redrawn``)."""
        return self._read.tokens

    def result(self, *, trace_nan: bool = True) -> SamplerOutput:
        """The read (it waits for this call's copy alone) and the rare rows' exact pass.
        ``trace_nan`` replays the processors to name the source of a NaN: only right after
        ``start`` (their state is this call's)."""
        return self._sampler._finish(self._call, self._read, self._pristine, self._md, trace_nan=trace_nan)


@dataclass
class _Scratch:
    """The sampler's large temporaries, one slot per use; each is reused from call to call."""

    raw: Buffer = field(default_factory=Buffer)  # 1: the raw logprobs (or logits) of the rows asking
    probs: Buffer = field(default_factory=Buffer)  # 7c: the full rows' probabilities
    nucleus: Buffer = field(default_factory=Buffer)  # 7c: scattered top-p rows, gathered for the histogram
    rank: Buffer = field(default_factory=Buffer)  # 8: the rank count's 0/1 floats
    top_p: TopPScratch = field(default_factory=TopPScratch)  # 7c: the histogram's own


@dataclass(frozen=True)
class _Candidates:
    """Random rows drawn among candidate lists (top-k rows, probe hits): ids in top-p order, kept mask."""

    ids: torch.Tensor
    keep: torch.Tensor


@dataclass(frozen=True)
class _ExactTopK:
    """An exact top-k (``ops.select``): the candidates, and the flags of the rows whose ties
    straddle the k-th place (their ids among the tie are arbitrary until ``finish`` is told them)."""

    vals: torch.Tensor
    ids: torch.Tensor
    k: torch.Tensor  # [n] each row's own k
    kmax: int
    rows: RowGroup | None  # rows of x the candidates come from (None: all, in order)
    tied: torch.Tensor  # [n] bool, on the device

    @staticmethod
    def start(
        x: torch.Tensor, k: torch.Tensor, kmax: int, rows: RowGroup | None = None, *, finite_ties_only: bool = False
    ) -> _ExactTopK:
        vals, ids = topk_candidates(x, kmax, rows)
        tied = ambiguous(vals, k)
        if finite_ties_only:  # ties of -inf at the k-th place change no draw (they carry no mass)
            tied &= torch.isfinite(vals.gather(1, (k - 1)[:, None]).squeeze(1))
        return _ExactTopK(vals, ids, k, kmax, rows, tied)

    def finish(self, x: torch.Tensor, exact: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-``kmax`` columns; exact where no tie straddles the k-th place and on the rows
        ``exact`` (host list: the tied rows, once read), arbitrary among the tie elsewhere."""
        index = None if self.rows is None else self.rows.index
        return resolve_topk(x, self.vals, self.ids, self.k, self.kmax, list(exact), rows=index)


@dataclass(frozen=True)
class _LogprobRows:
    """Step 8's input for one row group: its logprob (or logit) rows and their top-K in flight."""

    rows: RowGroup
    src: torch.Tensor  # [len(rows), V]
    topk: _ExactTopK | None  # None: the rows asked for no top-K

    @staticmethod
    def start(rows: RowGroup, src: torch.Tensor, num_logprobs: int | None) -> _LogprobRows:
        k = min(num_logprobs or 0, src.shape[1])
        if k <= 0:
            return _LogprobRows(rows, src, None)
        kk = torch.full((src.shape[0],), k, dtype=torch.int64, device=src.device)
        return _LogprobRows(rows, src, _ExactTopK.start(src, kk, k))


@dataclass
class _Call:
    """One ``Sampler.__call__``: the logits being processed and what the steps have decided so far."""

    x: torch.Tensor  # [B, V] float32, processed in place
    plan: SamplingPlan
    scratch: _Scratch
    tokens: torch.Tensor  # [B] int64
    ok: torch.Tensor  # [B] bool
    bmax: torch.Tensor | None = None  # block maxima after step 6: the non-finite flags, greedy argmax
    nf: NonFinite | None = None  # the rows' NaN / +inf flags after step 6
    u: torch.Tensor | None = None  # 7d: the random rows' uniforms (the exact pass draws with them again)
    raw: _LogprobRows | None = None  # 1
    greedy_processed: torch.Tensor | None = None  # 7: the processed-mode rows as step 7 saw them
    topk: _TopKRows | None = None  # 7c-7d
    full: _FullRows | None = None  # 7c-7d
    raw_exact: list[int] = field(default_factory=list)  # step 1 rows whose top-K tie the exact pass resolves

    def decide(self, rows: RowGroup, tokens: torch.Tensor, ok: torch.Tensor) -> None:
        self.tokens.index_copy_(0, rows.index, tokens)
        self.ok.index_copy_(0, rows.index, ok)


class _TopKRows:
    """7c-7d for the rows with 0 < top_k < V: exact top-k, top-p over the renormalised candidates,
    the draw among them.

    A tie straddling the k-th place leaves the tied candidates' ids arbitrary, but not their
    values: every position's probability, the top-p cut and the drawn column are what the exact
    ids give. Only a draw that lands on a probability equal to the k-th one can take a wrong
    id; ``redo`` flags those rows for the exact pass, which draws again with the exact ids.
    """

    def __init__(self, call: _Call) -> None:
        plan = call.plan
        self.exact = _ExactTopK.start(call.x, plan.topk_k, plan.topk_kmax, plan.topk, finite_ties_only=True)
        self.kept: _Candidates | None = None  # set by draw
        self.redo: torch.Tensor | None = None  # [nk] bool, set by draw

    def draw(self, call: _Call, u: torch.Tensor, exact: Sequence[int] = ()) -> None:
        plan = call.plan
        vals, ids = self.exact.finish(call.x, exact)
        in_k = torch.arange(plan.topk_kmax, device=vals.device)[None, :] < plan.topk_k[:, None]
        q = torch.softmax(vals.masked_fill(~in_k, _NEG_INF), -1)
        perm = _order_by_prob(q, ids)
        ids, q, in_k = ids.gather(1, perm), q.gather(1, perm), in_k.gather(1, perm)
        keep = top_p_keep(q, plan.topk_p) & in_k
        col, row_ok = draw_weights(q * keep, u)
        call.decide(plan.topk, ids.gather(1, col[:, None]).squeeze(1), row_ok)
        self.kept = _Candidates(ids, keep)
        kth = q.gather(1, (plan.topk_k - 1)[:, None])  # q is in descending order: the k-th probability
        self.redo = self.exact.tied & row_ok & (q.gather(1, col[:, None]) == kth).squeeze(1)


class _FullRows:
    """7c-7d for the other random rows: softmax over the vocabulary, top-p (the probe, else the
    histogram), the two-level inverse-CDF draw.

    ``draw`` settles every row the probe settles (and every row without top-p); a valid top-p
    row whose nucleus does not fit the probe is flagged in ``missed``, and the exact pass cuts it
    with the histogram and draws it again (``redraw``)."""

    def __init__(self, call: _Call) -> None:
        plan, ntp = call.plan, call.plan.n_top_p
        self.probs = softmax_rows(
            call.x, plan.full, call.scratch.probs.take((len(plan.full), plan.vocab_size), torch.float32, call.x.device)
        )
        self._bsum = row_block_sums(self.probs)
        totals = row_total(self._bsum.to(torch.float64))
        self.valid = ((totals > 0) & torch.isfinite(totals))[:ntp]  # [ntp] bool
        self.probe: _Candidates | None = None
        self.hit: torch.Tensor | None = None  # [ntp] bool: the probe settled the row's nucleus
        self.missed: torch.Tensor | None = None  # [ntp] bool: valid, not settled by the probe
        self.hits: list[bool] = []  # host copy of ``hit``, set by redraw
        self.histogram_rows: tuple[int, ...] = ()  # set by redraw: top-p rows cut by the histogram
        if ntp:
            ids, self._probe_probs, keep, self.hit = top_p_probe(self.probs[:ntp], plan.top_p, totals[:ntp])
            self.probe = _Candidates(ids, keep)
            self.missed = self.valid & ~self.hit

    def draw(self, call: _Call, u: torch.Tensor) -> None:
        tok, row_ok = draw_rows(self.probs, u, self._bsum)
        if self.hit is not None:
            assert self.probe is not None
            ntp = call.plan.n_top_p
            col, _ = draw_weights(self._probe_probs * self.probe.keep, u[:ntp])
            tok[:ntp] = torch.where(self.hit, self.probe.ids.gather(1, col[:, None]).squeeze(1), tok[:ntp])
        call.decide(call.plan.full, tok, row_ok)

    def redraw(self, call: _Call, u: torch.Tensor, hits: list[bool], valid: list[bool]) -> None:
        """The exact pass, given the host copies of ``hit`` and ``valid``: the histogram cuts the
        rows the probe missed, and every row is drawn again from the same uniforms."""
        self.hits = hits
        self.histogram_rows = tuple(i for i in range(call.plan.n_top_p) if valid[i] and not hits[i])
        if self.histogram_rows:
            self._nucleus_by_histogram(call, valid)
            self.draw(call, u)

    def _nucleus_by_histogram(self, call: _Call, valid: list[bool]) -> None:
        """Top-p on ``histogram_rows`` in place; their block sums refreshed.

        When those rows nearly fill a slice of ``probs`` (every row in it valid), the slice is
        cut in place: the probe-settled rows among them lose only what top-p removes, which no
        later step reads. Otherwise the rows are gathered, cut and written back.
        """
        rows, top_p = self.histogram_rows, call.plan.top_p
        lo, hi = rows[0], rows[-1] + 1
        if (hi - lo) - len(rows) <= len(rows) // 4 and all(valid[lo:hi]):
            part = self.probs[lo:hi]
            top_p_histogram_(part, top_p[lo:hi], call.scratch.top_p)
            self._bsum[lo:hi] = row_block_sums(part)
            return
        idx = to_device(rows, torch.int64, self.probs.device)
        out = call.scratch.nucleus.take((len(rows), self.probs.shape[1]), self.probs.dtype, self.probs.device)
        part = torch.index_select(self.probs, 0, idx, out=out)
        top_p_histogram_(part, top_p.index_select(0, idx), call.scratch.top_p)
        self.probs.index_copy_(0, idx, part)
        self._bsum.index_copy_(0, idx, row_block_sums(part))


@dataclass(frozen=True)
class _Read:
    """What one host read brought: the results, and the flags that say whether the exact pass
    must run (host lists, empty where the group has no rows)."""

    tokens: torch.Tensor  # [B] int64, host
    errors: torch.Tensor  # [B] bool, host
    logprobs: LogprobsTensors | None  # host
    nan: list[bool] = field(default_factory=list)  # the first read's: rows that held NaN after step 6
    topk_tied: list[bool] = field(default_factory=list)
    topk_redo: list[bool] = field(default_factory=list)
    hits: list[bool] = field(default_factory=list)
    valid: list[bool] = field(default_factory=list)
    missed: list[bool] = field(default_factory=list)
    raw_tied: list[bool] = field(default_factory=list)

    def needs_exact_pass(self, plan: SamplingPlan) -> bool:
        return bool(len(plan.processed) or any(self.topk_redo) or any(self.missed) or any(self.raw_tied))


@dataclass(frozen=True)
class _PendingRead:
    """A read issued after step 8: ``tokens`` on the device now, the host copy once waited for."""

    tokens: torch.Tensor  # [B] int64 on the device, -1 on failed rows
    copy: HostCopy
    num_results: int  # tokens, errors (and the three logprobs tensors)
    has_logprobs: bool
    flags: tuple[str, ...]

    def wait(self) -> _Read:
        host = self.copy.wait()
        n = self.num_results
        lp_host = LogprobsTensors(*host[2:5]) if self.has_logprobs else None
        lists = dict(zip(self.flags, as_lists(*host[n:])))
        return _Read(host[0], host[1], lp_host, **lists)


def _apply(p: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
    try:
        out = p.apply(logits)
    except Exception as exc:
        raise ProcessorError(type(p).__name__, "apply", exc) from exc
    if out is not logits:
        out = out.to(torch.float32).contiguous()
    return out


def _keep_only(out: torch.Tensor, x: torch.Tensor, cand: _Candidates, i: int) -> None:
    """Row ``out`` [V] becomes -inf but at the candidates row ``i`` of ``cand`` kept, which take ``x``'s values."""
    kept = torch.where(cand.keep[i], x[cand.ids[i]], _NEG_INF)
    out.fill_(_NEG_INF)
    out[cand.ids[i]] = kept


def _order_by_prob(q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Permutation putting candidates in top-p order: probability desc, id asc."""
    o1 = torch.argsort(ids, dim=-1, stable=True)
    o2 = torch.argsort(q.gather(1, o1), dim=-1, descending=True, stable=True)
    return o1.gather(1, o2)


class Sampler:
    """``Sampler(processors)(logits, metadata) -> SamplerOutput``; see the module docstring."""

    def __init__(self, processors: ProcessorSet, *, generator: torch.Generator | None = None) -> None:
        self.processors = processors
        self.generator = generator
        self._plan_key: tuple[SamplingMetadata, int, torch.device] | None = None
        self._plan: SamplingPlan | None = None
        self._scratch = _Scratch()

    def _plan_for(self, md: SamplingMetadata, logits: torch.Tensor) -> SamplingPlan:
        key = (md, logits.shape[1], logits.device)
        if self._plan is None or self._plan_key is None or self._plan_key[0] is not md or self._plan_key[1:] != key[1:]:
            if md.batch_size != logits.shape[0]:
                raise ValueError(f"logits have {logits.shape[0]} rows but the metadata {md.batch_size}")
            self._plan = build_plan(md, logits.shape[1], logits.device)
            self._plan_key = key
        return self._plan

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, *, pristine: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample one token per row. float32 ``logits`` are processed in place; ``pristine`` (an
        untouched copy, when the caller keeps one) lets a NaN be traced to the processor that made it.
        The output is on the host (see the module docstring for its reads).
        """
        return self.start(logits, metadata, pristine=pristine).result()

    def start(
        self, logits: torch.Tensor, metadata: SamplingMetadata, *, pristine: torch.Tensor | None = None
    ) -> PendingSample:
        """Steps 1-7 on the device, no read yet: ``result()`` makes the call's read (async
        scheduling launches the next step in between). Processors run here, not in ``result``."""
        call = self._start(logits, metadata)  # 2
        if pristine is None and call.x is not logits:
            pristine = logits
        call.raw = self._keep_raw(call)  # 1 (reads the float32 logits before any write)
        call.x = self._before_sampling(call.x, metadata)  # 3-6
        self._non_finite(call)
        self._greedy(call)  # 7
        if not call.plan.all_greedy:
            self._temperature_and_invariant(call)  # 7a-7b
            self._top_k_top_p_and_draw(call)  # 7c-7d
        return PendingSample(self, call, self._read(call, first=True), pristine, metadata)  # 8, read issued

    def _finish(
        self,
        call: _Call,
        first_read: _PendingRead,
        pristine: torch.Tensor | None,
        metadata: SamplingMetadata,
        *,
        trace_nan: bool,
    ) -> SamplerOutput:
        read = first_read.wait()  # the step's one host read
        redrawn: tuple[int, ...] = ()
        if read.needs_exact_pass(call.plan):
            self._exact_pass(call, read)
            first, read = read, replace(self._read(call, first=False).wait(), nan=read.nan)
            (changed,) = as_lists((read.tokens != first.tokens).nonzero().flatten())
            redrawn = tuple(changed)
        errors = self._error_messages(call, pristine if trace_nan else None, metadata, read)
        return SamplerOutput(read.tokens, read.logprobs, read.errors, errors, redrawn)  # 9

    def _start(self, logits: torch.Tensor, metadata: SamplingMetadata) -> _Call:
        plan = self._plan_for(metadata, logits)
        x = (logits if logits.dtype == torch.float32 else logits.float()).contiguous()  # 2
        b, dev = plan.batch_size, x.device
        tokens = torch.full((b,), -1, dtype=torch.int64, device=dev)
        return _Call(x, plan, self._scratch, tokens, torch.ones(b, dtype=torch.bool, device=dev))

    # -- step 1 ----------------------------------------------------------------------------

    def _keep_raw(self, call: _Call) -> _LogprobRows | None:
        plan = call.plan
        if not len(plan.raw):
            return None
        out = call.scratch.raw.take((len(plan.raw), call.x.shape[1]), torch.float32, call.x.device)
        src = logprob_rows(call.x, plan.raw, plan.raw_modes, out)
        return _LogprobRows.start(plan.raw, src, plan.num_logprobs)

    # -- steps 3-6 and the non-finite rules ------------------------------------------------

    def _before_sampling(self, x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 3-6: the non-argmax-invariant processors in registry order, then penalties."""
        for p in self.processors.non_argmax_invariant:  # 3-5
            x = _apply(p, x)
        if not metadata.no_penalties:  # 6
            x = _apply(self.processors.penalties, x)
        return x

    @staticmethod
    def _non_finite(call: _Call) -> None:
        """The rows' NaN / +inf flags from the block maxima (which greedy argmax then reuses).

        When random rows follow, the rules rewrite every row now (``ops.non_finite``: two passes,
        no read), so steps 7a-7d and the argmax-invariant processors see the rewritten rows. An
        all-greedy batch needs no rewrite: its argmax already takes the lowest ``+inf`` id.
        """
        call.bmax = block_reduce(call.x, block_size(call.x.shape[1]), "amax")
        call.nf = non_finite_rows(call.bmax)
        if not call.plan.all_greedy:
            resolve_non_finite_(call.x, call.nf)
            resolve_non_finite_(call.bmax, call.nf)

    # -- step 7 ----------------------------------------------------------------------------

    @staticmethod
    def _greedy(call: _Call) -> None:
        """Greedy tokens: the argmax reads only each row's winning block (``call.bmax`` has the rest).

        A row fails when its best logit is -inf (or NaN); a row rewritten for ``+inf`` has 0 there,
        an all-greedy row keeps its ``+inf``, and both pass.
        """
        plan = call.plan
        if not len(plan.greedy):
            return
        vals, ids = row_argmax(call.x, call.bmax, rows=None if plan.all_greedy else plan.greedy.index)
        call.decide(plan.greedy, ids, vals > _NEG_INF)
        if len(plan.processed):
            # Greedy rows' processed logits are fixed here: 7b must not change a greedy row's results.
            call.greedy_processed = call.x.index_select(0, plan.processed.index)
            if plan.all_greedy:  # not rewritten above: the rules apply to this copy
                assert call.nf is not None
                resolve_non_finite_(call.greedy_processed, call.nf.index_select(plan.processed.index))

    def _temperature_and_invariant(self, call: _Call) -> None:
        x, plan = call.x, call.plan
        assert plan.divisor is not None  # None only when every row is greedy, and then 7 ends here
        for r in plan.random.runs:  # 7a
            x[r.batch : r.batch + r.length].div_(plan.divisor[r.batch : r.batch + r.length])
        for p in self.processors.argmax_invariant:  # 7b
            x = _apply(p, x)
        call.x = x

    def _top_k_top_p_and_draw(self, call: _Call) -> None:
        """7c-7d for every random row, without a host read: the rows a tie or the probe leaves
        unsettled are flagged for the exact pass."""
        plan = call.plan
        call.u = uniforms(plan.random_rows, plan.generators, self.generator, call.x.device, plan.seeded_index)
        nk = len(plan.topk)
        call.topk = _TopKRows(call) if nk else None
        call.full = _FullRows(call) if len(plan.full) else None
        if call.topk is not None:
            call.topk.draw(call, call.u[:nk])
        if call.full is not None:
            call.full.draw(call, call.u[nk:])

    # -- the host read, and the exact pass -------------------------------------------------------

    @staticmethod
    def _final_tokens(call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
        """([B] tokens with -1 on failed rows, [B] bool failed)."""
        assert call.nf is not None
        ok = call.ok & ~call.nf.nan
        return torch.where(ok, call.tokens, -1), ~ok

    def _read(self, call: _Call, *, first: bool) -> _PendingRead:
        """Step 8 on the device, then ONE transfer (issued, not waited for) of the tokens, the
        failure flags, the logprobs and (``first``) the flags that decide the exact pass."""
        assert call.nf is not None
        tokens, errors = self._final_tokens(call)
        lp = self._logprobs(call, tokens, exact=not first)
        tensors = [tokens, errors]
        if lp is not None:
            tensors += [lp.token_ids, lp.logprobs, lp.ranks]
        flags: dict[str, torch.Tensor] = {}
        if first:
            flags["nan"] = call.nf.nan
            if call.topk is not None:
                assert call.topk.redo is not None
                flags["topk_tied"], flags["topk_redo"] = call.topk.exact.tied, call.topk.redo
            if call.full is not None and call.full.missed is not None:
                assert call.full.hit is not None
                flags["hits"], flags["valid"], flags["missed"] = call.full.hit, call.full.valid, call.full.missed
            if call.raw is not None and call.raw.topk is not None:
                flags["raw_tied"] = call.raw.topk.tied
        copy = start_to_host(*tensors, *flags.values(), label="sampler" if first else "sampler exact pass")
        return _PendingRead(tokens, copy, len(tensors), lp is not None, tuple(flags))

    def _exact_pass(self, call: _Call, read: _Read) -> None:
        """The rare rows, exactly, after the first read: top-k rows whose draw met a tie, top-p rows
        the probe missed (histogram), and (step 8, in the next read) logprob top-K ties and the
        processed modes. Draws reuse the step's uniforms, so every stream is the one-pass one."""
        assert call.u is not None or call.plan.all_greedy
        nk = len(call.plan.topk)
        if call.topk is not None and any(read.topk_tied):
            assert call.u is not None
            call.topk.draw(call, call.u[:nk], [i for i, t in enumerate(read.topk_tied) if t])
        if call.full is not None and call.full.hit is not None:
            assert call.u is not None
            call.full.redraw(call, call.u[nk:], read.hits, read.valid)
        call.raw_exact = [i for i, t in enumerate(read.raw_tied) if t]

    # -- step 8 ----------------------------------------------------------------------------

    def _logprobs(self, call: _Call, tokens: torch.Tensor, *, exact: bool) -> LogprobsTensors | None:
        """Step 8 on the device. Not ``exact`` (the first read): raw top-K ties are flagged, not
        resolved, and processed-mode rows are left for the exact pass."""
        plan = call.plan
        if plan.num_logprobs is None:
            return None
        b, k, dev = plan.batch_size, plan.num_logprobs, call.x.device
        ids_out = torch.full((b, k + 1), -1, dtype=torch.int64, device=dev)
        ids_out[:, 0] = tokens
        lp_out = torch.full((b, k + 1), float("nan"), dtype=torch.float32, device=dev)
        ranks = torch.full((b,), -1, dtype=torch.int64, device=dev)
        sources: list[tuple[_LogprobRows, Sequence[int]]] = []
        if call.raw is not None:
            sources.append((call.raw, call.raw_exact if exact else ()))
        if exact and len(plan.processed):
            src = to_logprobs_(self._processed_logits(call), plan.processed_modes)
            sources.append((_LogprobRows.start(plan.processed, src, plan.num_logprobs), range(len(plan.processed))))
        for s, exact_rows in sources:
            rows = s.rows.index
            lp, rank = sampled_logprob_and_rank(s.src, tokens.index_select(0, rows), call.scratch.rank)
            lp_out[rows, 0] = lp
            ranks[rows] = rank
            if s.topk is not None:
                vals, ids = sort_by_value_then_id(*s.topk.finish(s.src, exact_rows))
                lp_out[rows, 1 : 1 + s.topk.kmax] = vals
                ids_out[rows, 1 : 1 + s.topk.kmax] = ids
        return LogprobsTensors(ids_out, lp_out, ranks)

    @staticmethod
    def _processed_logits(call: _Call) -> torch.Tensor:
        """Logits after 7c of the rows asking a processed mode: -inf where top-k/top-p removed a token.

        Opt-in and rare, so this walks those rows (device ops only, in the exact pass: the probe
        hits and the histogram rows are known on the host by then).
        """
        x, plan = call.x, call.plan
        out = x.index_select(0, plan.processed.index)
        greedy = set(plan.greedy.rows)
        topk_pos = {r: i for i, r in enumerate(plan.topk.rows)}
        full_pos = {r: i for i, r in enumerate(plan.full.rows)}
        for local, r in enumerate(plan.processed.rows):
            if r in greedy:
                assert call.greedy_processed is not None
                out[local] = call.greedy_processed[local]
            elif r in topk_pos:
                assert call.topk is not None and call.topk.kept is not None
                _keep_only(out[local], x[r], call.topk.kept, topk_pos[r])
            else:
                full, i = call.full, full_pos[r]
                assert full is not None
                if i < plan.n_top_p and full.hits[i]:
                    assert full.probe is not None
                    _keep_only(out[local], x[r], full.probe, i)
                elif i in full.histogram_rows:
                    out[local] = torch.where(full.probs[i] > 0, out[local], _NEG_INF)
        return out

    # -- errors (only when a row failed) ---------------------------------------------------------

    def _error_messages(
        self, call: _Call, pristine: torch.Tensor | None, metadata: SamplingMetadata, read: _Read
    ) -> dict[int, str]:
        """Per failed row: NaN (before or after step 7b) or every token excluded.

        Only NaN needs a message beyond the default (every token excluded): from steps 3-6 (the
        flags, read already) or from an argmax-invariant processor (7b ran: look, one more read).
        """
        plan = call.plan
        (errors,) = as_lists(read.errors)
        bad = [r for r, e in enumerate(errors) if e]
        if not bad:
            return {}
        nan_now = [False] * len(bad)
        if not plan.all_greedy:
            idx = torch.tensor(bad, device=call.x.device)
            (nan_now,) = host_lists(torch.isnan(call.x.index_select(0, idx)).any(-1), label="sampler errors")
        nan = [r for r, now in zip(bad, nan_now) if now or read.nan[r]]
        sources = self._nan_sources(pristine, nan, metadata, plan) if nan and pristine is not None else {}
        out = {}
        for r in bad:
            if r in nan:
                src = sources.get(r)
                out[r] = NAN_LOGITS + (f" (produced by {src})" if src else "")
            else:
                out[r] = NO_FINITE_LOGIT
        return out

    def _nan_sources(
        self, pristine: torch.Tensor, rows: list[int], metadata: SamplingMetadata, plan: SamplingPlan
    ) -> dict[int, str]:
        """Replay steps 2-7b on a copy of the untouched logits and name, per row, the first stage
        after which it held NaN: "the model" or a processor's class name. Error path only."""
        y = pristine.to(torch.float32, copy=True).contiguous()
        idx = torch.tensor(rows, device=y.device)
        found: dict[int, str] = {}

        def note(stage: str) -> None:
            (now,) = host_lists(torch.isnan(y.index_select(0, idx)).any(-1), label="sampler NaN replay")
            for r, is_nan in zip(rows, now):
                if is_nan:
                    found.setdefault(r, stage)

        note("the model")
        stages = list(self.processors.non_argmax_invariant)
        if not metadata.no_penalties:
            stages.append(self.processors.penalties)
        try:
            for p in stages:
                y = _apply(p, y)
                note(f"logits processor {type(p).__name__}")
            if not plan.all_greedy:
                resolve_non_finite_(y, non_finite_rows(y))
                assert plan.divisor is not None  # a plan with random rows has one
                y.div_(plan.divisor)
                for p in self.processors.argmax_invariant:
                    y = _apply(p, y)
                    note(f"logits processor {type(p).__name__}")
        except ProcessorError:
            pass  # the replay is best effort: the row fails either way
        return found

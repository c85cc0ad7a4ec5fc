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

Non-finite logits, row by row (checked once after step 6 by ``ops.non_finite`` on the block
maxima, which greedy argmax then reuses; one host read, nothing more in the common all-finite
case): a row holding ``+inf`` is forced,
its ``+inf`` tokens become 0 and every other token -inf, so greedy takes the lowest such id and
a draw is uniform among them; a row holding NaN fails. A row left with no finite logit (or NaN)
gets ``errors[row] = True``, token -1 and a message in ``error_messages``; the others are not
affected. Host reads: the plan is read once per metadata object (i.e. per batch change); per
step, the small routing flags (top-k ties, top-p probe hits, row validity, logprob ties) are
read together in one transfer (``ops.host_reads``). Rows whose top-p nucleus does not fit the
probe take a ``nonzero`` (one more sync on CUDA), and processed-mode logprob top-K one more read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from worker.logits_processor.errors import ProcessorError
from worker.logits_processor.interface import LogitsProcessor
from worker.ops.blocks import block_reduce, block_size
from worker.ops.draw import draw_rows, draw_weights, row_block_sums, row_total, softmax_rows, uniforms
from worker.ops.host_reads import HostReads
from worker.ops.logprobs import logprob_rows, sampled_logprob_and_rank, to_logprobs_
from worker.ops.non_finite import resolve_non_finite_
from worker.ops.plan import RowGroup, SamplingPlan, build_plan
from worker.ops.scratch import Buffer
from worker.ops.select import ambiguous, resolve_topk, row_argmax, sort_by_value_then_id, topk_candidates
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
    sampled_token_ids: torch.Tensor  # [B] int64; -1 where errors
    logprobs: LogprobsTensors | None
    errors: torch.Tensor  # [B] bool: the row had no finite logit left, or held NaN
    # Why error rows failed (host side): NaN and its source, or every token excluded. A failed row
    # missing here had every token excluded (NO_FINITE_LOGIT).
    error_messages: dict[int, str] = field(default_factory=dict)


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
    """An exact top-k (``ops.select``) between its halves: the candidates, and the queued flags of
    the rows whose ties straddle the k-th place, which ``finish`` resolves once they are read."""

    vals: torch.Tensor
    ids: torch.Tensor
    k: torch.Tensor  # [n] each row's own k
    kmax: int
    rows: RowGroup | None  # rows of x the candidates come from (None: all, in order)
    tied: int  # HostReads handle

    @staticmethod
    def start(
        x: torch.Tensor,
        k: torch.Tensor,
        kmax: int,
        host: HostReads,
        rows: RowGroup | None = None,
        *,
        finite_ties_only: bool = False,
    ) -> _ExactTopK:
        vals, ids = topk_candidates(x, kmax, rows)
        tied = ambiguous(vals, k)
        if finite_ties_only:  # ties of -inf at the k-th place change no draw (they carry no mass)
            tied &= torch.isfinite(vals.gather(1, (k - 1)[:, None]).squeeze(1))
        return _ExactTopK(vals, ids, k, kmax, rows, host.queue(tied))

    def finish(self, x: torch.Tensor, host: HostReads) -> tuple[torch.Tensor, torch.Tensor]:
        tied = [i for i, a in enumerate(host.read(self.tied)) if a]
        index = None if self.rows is None else self.rows.index
        return resolve_topk(x, self.vals, self.ids, self.k, self.kmax, tied, rows=index)


@dataclass(frozen=True)
class _LogprobRows:
    """Step 8's input for one row group: its logprob (or logit) rows and their top-K in flight."""

    rows: RowGroup
    src: torch.Tensor  # [len(rows), V]
    topk: _ExactTopK | None  # None: the rows asked for no top-K

    @staticmethod
    def start(rows: RowGroup, src: torch.Tensor, num_logprobs: int | None, host: HostReads) -> _LogprobRows:
        k = min(num_logprobs or 0, src.shape[1])
        if k <= 0:
            return _LogprobRows(rows, src, None)
        kk = torch.full((src.shape[0],), k, dtype=torch.int64, device=src.device)
        return _LogprobRows(rows, src, _ExactTopK.start(src, kk, k, host))


@dataclass
class _Call:
    """One ``Sampler.__call__``: the logits being processed and what the steps have decided so far."""

    x: torch.Tensor  # [B, V] float32, processed in place
    plan: SamplingPlan
    scratch: _Scratch
    host: HostReads
    tokens: torch.Tensor  # [B] int64
    ok: torch.Tensor  # [B] bool
    bmax: torch.Tensor | None = None  # block maxima after step 6: the non-finite check, greedy argmax
    nan_rows: torch.Tensor | None = None  # [B] bool, None when no row held NaN
    raw: _LogprobRows | None = None  # 1
    greedy_processed: torch.Tensor | None = None  # 7: the processed-mode rows as step 7 saw them
    topk: _TopKRows | None = None  # 7c-7d
    full: _FullRows | None = None  # 7c-7d

    def decide(self, rows: RowGroup, tokens: torch.Tensor, ok: torch.Tensor) -> None:
        self.tokens.index_copy_(0, rows.index, tokens)
        self.ok.index_copy_(0, rows.index, ok)


class _TopKRows:
    """7c-7d for the rows with 0 < top_k < V: exact top-k, top-p over the renormalised candidates,
    the draw among them. The constructor queues the tie flags; ``draw`` runs after they are read."""

    def __init__(self, call: _Call) -> None:
        plan = call.plan
        self._topk = _ExactTopK.start(call.x, plan.topk_k, plan.topk_kmax, call.host, plan.topk, finite_ties_only=True)
        self.kept: _Candidates | None = None  # set by draw

    def draw(self, call: _Call, u: torch.Tensor) -> None:
        plan = call.plan
        vals, ids = self._topk.finish(call.x, call.host)
        in_k = torch.arange(plan.topk_kmax, device=vals.device)[None, :] < plan.topk_k[:, None]
        q = torch.softmax(vals.masked_fill(~in_k, _NEG_INF), -1)
        perm = _order_by_prob(q, ids)
        ids, q, in_k = ids.gather(1, perm), q.gather(1, perm), in_k.gather(1, perm)
        keep = top_p_keep(q, plan.topk_p) & in_k
        col, row_ok = draw_weights(q * keep, u)
        call.decide(plan.topk, ids.gather(1, col[:, None]).squeeze(1), row_ok)
        self.kept = _Candidates(ids, keep)


class _FullRows:
    """7c-7d for the other random rows: softmax over the vocabulary, top-p (the probe, else the
    histogram), the two-level inverse-CDF draw. The constructor queues the rows' validity and
    probe flags; ``draw`` runs after they are read."""

    def __init__(self, call: _Call) -> None:
        plan, ntp = call.plan, call.plan.n_top_p
        self.probs = softmax_rows(
            call.x, plan.full, call.scratch.probs.take((len(plan.full), plan.vocab_size), torch.float32, call.x.device)
        )
        self._bsum = row_block_sums(self.probs)
        totals = row_total(self._bsum.to(torch.float64))
        self._valid = call.host.queue((totals > 0) & torch.isfinite(totals))
        self.probe: _Candidates | None = None
        self.hits: list[int] = []  # per top-p row, set by draw: the probe settled its nucleus
        self.histogram_rows: tuple[int, ...] = ()  # set by draw: top-p rows cut by the histogram
        if ntp:
            ids, self._probe_probs, keep, hit = top_p_probe(self.probs[:ntp], plan.top_p, totals[:ntp])
            self.probe, self._hits = _Candidates(ids, keep), call.host.queue(hit)

    def draw(self, call: _Call, u: torch.Tensor) -> None:
        plan, ntp = call.plan, call.plan.n_top_p
        valid = call.host.read(self._valid)
        self.hits = call.host.read(self._hits) if ntp else []
        self.histogram_rows = tuple(i for i in range(ntp) if valid[i] and not self.hits[i])
        if self.histogram_rows:
            self._nucleus_by_histogram(call, valid)
        tok, row_ok = draw_rows(self.probs, u, self._bsum)
        if any(self.hits):
            assert self.probe is not None
            col, _ = draw_weights(self._probe_probs * self.probe.keep, u[:ntp])
            hit = torch.tensor(self.hits, dtype=torch.bool, device=tok.device)
            tok[:ntp] = torch.where(hit, self.probe.ids.gather(1, col[:, None]).squeeze(1), tok[:ntp])
        call.decide(plan.full, tok, row_ok)

    def _nucleus_by_histogram(self, call: _Call, valid: list[int]) -> None:
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
        idx = torch.tensor(rows, device=self.probs.device)
        out = call.scratch.nucleus.take((len(rows), self.probs.shape[1]), self.probs.dtype, self.probs.device)
        part = torch.index_select(self.probs, 0, idx, out=out)
        top_p_histogram_(part, top_p.index_select(0, idx), call.scratch.top_p)
        self.probs.index_copy_(0, idx, part)
        self._bsum.index_copy_(0, idx, row_block_sums(part))


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
        """
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
        if call.nan_rows is not None:
            call.ok &= ~call.nan_rows
        call.tokens = torch.where(call.ok, call.tokens, -1)
        logprobs = self._logprobs(call)  # 8
        return SamplerOutput(call.tokens, logprobs, ~call.ok, self._error_messages(call, pristine, metadata))  # 9

    def _start(self, logits: torch.Tensor, metadata: SamplingMetadata) -> _Call:
        plan = self._plan_for(metadata, logits)
        x = (logits if logits.dtype == torch.float32 else logits.float()).contiguous()  # 2
        b, dev = plan.batch_size, x.device
        tokens = torch.full((b,), -1, dtype=torch.int64, device=dev)
        return _Call(x, plan, self._scratch, HostReads(), tokens, torch.ones(b, dtype=torch.bool, device=dev))

    # -- step 1 ----------------------------------------------------------------------------

    def _keep_raw(self, call: _Call) -> _LogprobRows | None:
        plan = call.plan
        if not len(plan.raw):
            return None
        out = call.scratch.raw.take((len(plan.raw), call.x.shape[1]), torch.float32, call.x.device)
        src = logprob_rows(call.x, plan.raw, plan.raw_modes, out)
        return _LogprobRows.start(plan.raw, src, plan.num_logprobs, call.host)

    # -- steps 3-6 and the non-finite check ------------------------------------------------

    def _before_sampling(self, x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 3-6: the non-argmax-invariant processors in registry order, then penalties."""
        for p in self.processors.non_argmax_invariant:  # 3-5
            x = _apply(p, x)
        if not metadata.no_penalties:  # 6
            x = _apply(self.processors.penalties, x)
        return x

    @staticmethod
    def _non_finite(call: _Call) -> None:
        # Block maxima: the non-finite check reads them, and greedy rows reuse them for argmax.
        call.bmax = block_reduce(call.x, block_size(call.x.shape[1]), "amax")
        call.nan_rows = resolve_non_finite_(call.x, call.bmax)

    # -- step 7 ----------------------------------------------------------------------------

    @staticmethod
    def _greedy(call: _Call) -> None:
        """Greedy tokens: the argmax reads only each row's winning block (``call.bmax`` has the rest)."""
        plan = call.plan
        if not len(plan.greedy):
            return
        vals, ids = row_argmax(call.x, call.bmax, rows=None if plan.all_greedy else plan.greedy.index)
        call.decide(plan.greedy, ids, torch.isfinite(vals))
        if len(plan.processed):
            # Greedy rows' processed logits are fixed here: 7b must not change a greedy row's results.
            call.greedy_processed = call.x.index_select(0, plan.processed.index)

    def _temperature_and_invariant(self, call: _Call) -> None:
        x, plan = call.x, call.plan
        assert plan.divisor is not None  # None only when every row is greedy, and then 7 ends here
        for r in plan.random.runs:  # 7a
            x[r.batch : r.batch + r.length].div_(plan.divisor[r.batch : r.batch + r.length])
        for p in self.processors.argmax_invariant:  # 7b
            x = _apply(p, x)
        call.x = x

    def _top_k_top_p_and_draw(self, call: _Call) -> None:
        """7c-7d for every random row. Both row groups queue their routing flags before either
        reads one, so the first read brings them all (and step 1's) in one transfer."""
        plan = call.plan
        u = uniforms(plan.random_rows, plan.generators, self.generator, call.x.device)
        nk = len(plan.topk)
        call.topk = _TopKRows(call) if nk else None
        call.full = _FullRows(call) if len(plan.full) else None
        if call.topk is not None:
            call.topk.draw(call, u[:nk])
        if call.full is not None:
            call.full.draw(call, u[nk:])

    # -- step 8 ----------------------------------------------------------------------------

    def _logprobs(self, call: _Call) -> LogprobsTensors | None:
        plan = call.plan
        if plan.num_logprobs is None:
            return None
        b, k, dev = plan.batch_size, plan.num_logprobs, call.x.device
        ids_out = torch.full((b, k + 1), -1, dtype=torch.int64, device=dev)
        ids_out[:, 0] = call.tokens
        lp_out = torch.full((b, k + 1), float("nan"), dtype=torch.float32, device=dev)
        ranks = torch.full((b,), -1, dtype=torch.int64, device=dev)
        sources = [call.raw] if call.raw is not None else []
        if len(plan.processed):
            src = to_logprobs_(self._processed_logits(call), plan.processed_modes)
            sources.append(_LogprobRows.start(plan.processed, src, plan.num_logprobs, call.host))
        for s in sources:
            rows = s.rows.index
            lp, rank = sampled_logprob_and_rank(s.src, call.tokens.index_select(0, rows), call.scratch.rank)
            lp_out[rows, 0] = lp
            ranks[rows] = rank
            if s.topk is not None:
                vals, ids = sort_by_value_then_id(*s.topk.finish(s.src, call.host))
                lp_out[rows, 1 : 1 + s.topk.kmax] = vals
                ids_out[rows, 1 : 1 + s.topk.kmax] = ids
        return LogprobsTensors(ids_out, lp_out, ranks)

    @staticmethod
    def _processed_logits(call: _Call) -> torch.Tensor:
        """Logits after 7c of the rows asking a processed mode: -inf where top-k/top-p removed a token.

        Opt-in and rare, so this walks those rows (device ops only, no host reads).
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

    def _error_messages(self, call: _Call, pristine: torch.Tensor | None, metadata: SamplingMetadata) -> dict[int, str]:
        """Per failed row: NaN (before or after step 7b) or every token excluded.

        Only NaN needs a message beyond the default (every token excluded): from steps 3-6 (known
        already) or from an argmax-invariant processor (7b ran: look, one read).
        """
        plan, nan_rows = call.plan, call.nan_rows
        if nan_rows is None and (plan.all_greedy or bool(call.ok.all())):
            return {}
        bad = (~call.ok).nonzero().flatten().tolist()
        nan_now = torch.isnan(call.x[bad]).any(-1).tolist()
        nan_before = nan_rows[bad].tolist() if nan_rows is not None else [False] * len(bad)
        nan = [r for r, a, b in zip(bad, nan_now, nan_before) if a or b]
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
            for r, is_nan in zip(rows, torch.isnan(y.index_select(0, idx)).any(-1).tolist()):
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
                resolve_non_finite_(y)
                assert plan.divisor is not None  # a plan with random rows has one
                y.div_(plan.divisor)
                for p in self.processors.argmax_invariant:
                    y = _apply(p, y)
                    note(f"logits processor {type(p).__name__}")
        except ProcessorError:
            pass  # the replay is best effort: the row fails either way
        return found

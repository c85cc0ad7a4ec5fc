"""The batched sampler (docs/sampling.md "The nine steps"): one token per row of
``(logits, metadata)``; the order is the contract.

1 keep raw logprobs / logits for rows that ask (before anything writes the logits)
2 float32
3-5 every non-argmax-invariant processor in registry order (allowed ids, bad words, min-tokens,
  logit bias, custom ones); an exception becomes ``ProcessorError(name, "apply", exc)``
6 penalties, unless no row uses one
7 greedy rows: argmax now (lowest id wins a tie), before temperature
7a temperature, in place (greedy rows divide by 1)
7b argmax-invariant processors (Min-P, ...) - not called at all when every row is greedy
7c top-k (exactly k, ties toward lower ids), then top-p (smallest prefix reaching p)
7d an exact inverse-CDF draw, one float64 uniform per row; seeded rows use their own generator
8 logprobs: top-K of the row's source, the sampled token's logprob and 1-based rank
9 return

Non-finite logits, row by row (checked once after step 6 by ``ops.non_finite`` on the block
maxima, which greedy argmax then reuses; one host read, nothing more in the common all-finite
case): a row holding ``+inf`` is forced,
its ``+inf`` tokens become 0 and every other token -inf, so greedy takes the lowest such id and
a draw is uniform among them; a row holding NaN fails. A row left with no finite logit (or NaN)
gets ``errors[row] = True``, token -1 and a message in ``error_messages``; the others are not
affected. Host reads: the plan is read once per metadata object (i.e. per batch change); per
step, the small routing flags (top-k ties, top-p probe hits, row validity, logprob ties) are
read together in one transfer. Rows whose top-p nucleus does not fit the probe take a
``nonzero`` (one more sync on CUDA), and processed-mode logprob top-K one more read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from worker.logits_processor.errors import ProcessorError
from worker.logits_processor.interface import LogitsProcessor
from worker.ops.blocks import block_reduce, block_size
from worker.ops.draw import draw_rows, draw_weights, row_block_sums, row_total, uniforms
from worker.ops.logprobs import sampled_logprob_and_rank, to_logprobs_
from worker.ops.non_finite import resolve_non_finite_
from worker.ops.plan import SamplingPlan, build_plan
from worker.ops.select import ambiguous, resolve_topk, row_argmax, sort_by_value_then_id, topk_candidates
from worker.ops.topk_topp import top_p_histogram_, top_p_keep, top_p_probe
from worker.ops.workspace import Workspace
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


class _HostRead:
    """Small device results collected so that they reach the host in one transfer."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._values: list[list[int]] = []

    def add(self, t: torch.Tensor) -> int:
        self._parts.append(t.reshape(-1).to(torch.int64))
        return len(self._parts) - 1

    def get(self, handle: int) -> list[int]:
        if handle >= len(self._values):
            new = self._parts[len(self._values) :]
            flat = torch.cat(new).tolist()
            for t in new:
                self._values.append(flat[: t.numel()])
                flat = flat[t.numel() :]
        return self._values[handle]


@dataclass
class _Candidates:
    """Rows sampled among candidate lists in top-p order: ids and kept mask."""

    ids: torch.Tensor
    keep: torch.Tensor


@dataclass
class _Drawn:
    """What the random path leaves for processed logprobs."""

    topk: _Candidates | None = None
    probe: _Candidates | None = None
    probe_hits: list[int] | None = None
    probs: torch.Tensor | None = None  # [nf, V] full-row probabilities after top-p
    histogram_rows: tuple[int, ...] = ()


@dataclass
class _TopKRows:
    """Phase 1 of the top-k rows: top-(kmax+1) candidates and the ambiguity flags' handle."""

    vals: torch.Tensor
    ids: torch.Tensor
    ambiguous: int


@dataclass
class _FullRows:
    """Phase 1 of the full-vocabulary rows: probabilities, block sums, probe, read handles."""

    probs: torch.Tensor
    bsum: torch.Tensor
    valid: int
    probe: _Candidates | None = None
    probe_probs: torch.Tensor | None = None
    probe_hits: int = -1


@dataclass
class _PendingTopK:
    vals: torch.Tensor
    ids: torch.Tensor
    k: int
    handle: int


def _apply(p: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
    try:
        out = p.apply(logits)
    except Exception as exc:
        raise ProcessorError(type(p).__name__, "apply", exc) from exc
    if out is not logits:
        out = out.to(torch.float32).contiguous()
    return out


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
        self._workspaces: dict[torch.device, Workspace] = {}

    def _plan_for(self, md: SamplingMetadata, logits: torch.Tensor) -> SamplingPlan:
        key = (md, logits.shape[1], logits.device)
        if self._plan is None or self._plan_key is None or self._plan_key[0] is not md or self._plan_key[1:] != key[1:]:
            if md.batch_size != logits.shape[0]:
                raise ValueError(f"logits have {logits.shape[0]} rows but the metadata {md.batch_size}")
            self._plan = build_plan(md, logits.shape[1], logits.device)
            self._plan_key = key
        return self._plan

    def _workspace(self, device: torch.device) -> Workspace:
        if device not in self._workspaces:
            self._workspaces[device] = Workspace(device)
        return self._workspaces[device]

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, *, pristine: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample one token per row. float32 ``logits`` are processed in place; ``pristine`` (an
        untouched copy, when the caller keeps one) lets a NaN be traced to the processor that made it.
        """
        plan = self._plan_for(metadata, logits)
        ws = self._workspace(logits.device)
        host = _HostRead()
        x = logits if logits.dtype == torch.float32 else logits.float()  # 2
        x = x.contiguous()
        if pristine is None and x is not logits:
            pristine = logits
        raw = self._keep_raw(x, plan, ws, host)  # 1 (reads the float32 logits before any write)
        x = self._before_sampling(x, metadata)  # 3-6
        # Block maxima: the non-finite check reads them, and greedy rows reuse them for argmax.
        bmax: torch.Tensor | None = block_reduce(x, block_size(x.shape[1]), "amax")
        nan_rows = resolve_non_finite_(x, bmax)
        if nan_rows is not None:
            bmax = None  # rows were rewritten

        tokens = torch.full((plan.batch_size,), -1, dtype=torch.int64, device=x.device)
        ok = torch.ones(plan.batch_size, dtype=torch.bool, device=x.device)
        greedy_processed = self._greedy(x, plan, ws, tokens, ok, bmax)  # 7
        drawn = None
        if not plan.all_greedy:
            x = self._temperature_and_invariant(x, plan)  # 7a-7b
            drawn = self._draw(x, plan, ws, host, tokens, ok)  # 7c-7d
        if nan_rows is not None:
            ok &= ~nan_rows
        tokens = torch.where(ok, tokens, -1)
        logprobs = self._logprobs(x, plan, ws, host, tokens, raw, greedy_processed, drawn)  # 8
        # Failed rows need a message beyond the default (every token excluded) only for NaN: from
        # steps 3-6 (known here) or from an argmax-invariant processor (7b ran: look, one read).
        may_nan = nan_rows is not None or (not plan.all_greedy and not bool(ok.all()))
        messages = self._error_messages(ok, x, nan_rows, pristine, metadata, plan) if may_nan else {}
        return SamplerOutput(tokens, logprobs, ~ok, messages)  # 9

    def _before_sampling(self, x: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 3-6: the non-argmax-invariant processors in registry order, then penalties."""
        for p in self.processors.non_argmax_invariant:  # 3-5
            x = _apply(p, x)
        if not metadata.no_penalties:  # 6
            x = _apply(self.processors.penalties, x)
        return x

    def _temperature_and_invariant(self, x: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
        assert plan.divisor is not None  # None only when every row is greedy, and then 7 ends here
        x.div_(plan.divisor)  # 7a
        for p in self.processors.argmax_invariant:  # 7b
            x = _apply(p, x)
        return x

    # -- errors (only when a row failed) ---------------------------------------------------------

    def _error_messages(
        self,
        ok: torch.Tensor,
        x: torch.Tensor,
        nan_rows: torch.Tensor | None,
        pristine: torch.Tensor | None,
        metadata: SamplingMetadata,
        plan: SamplingPlan,
    ) -> dict[int, str]:
        """Per failed row: NaN (before or after step 7b) or every token excluded."""
        bad = (~ok).nonzero().flatten().tolist()
        nan_now = torch.isnan(x[bad]).any(-1).tolist()
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

    # -- step 1 ----------------------------------------------------------------------------

    def _keep_raw(
        self, x: torch.Tensor, plan: SamplingPlan, ws: Workspace, host: _HostRead
    ) -> tuple[torch.Tensor, _PendingTopK | None] | None:
        if not len(plan.raw):
            return None
        src = ws.get("raw_src", (len(plan.raw), x.shape[1]), torch.float32)
        if plan.raw.rows == tuple(range(plan.batch_size)):
            src.copy_(x)
        else:
            torch.index_select(x, 0, plan.raw.index, out=src)
        to_logprobs_(src, plan.raw_modes)
        return src, self._logprob_topk_phase1(src, plan, host)

    # -- step 7 ----------------------------------------------------------------------------

    def _greedy(
        self,
        x: torch.Tensor,
        plan: SamplingPlan,
        ws: Workspace,
        tokens: torch.Tensor,
        ok: torch.Tensor,
        bmax: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Greedy tokens into ``tokens``/``ok``; returns the processed-logits snapshot of greedy rows.

        ``bmax``: the block maxima of ``x`` when the caller has them (saves the argmax its read pass).
        """
        if not len(plan.greedy):
            return None
        g = plan.greedy.index
        if 3 * len(plan.greedy) < plan.batch_size:  # few greedy rows: gathering them beats a full read
            rows = torch.index_select(x, 0, g, out=ws.get("greedy_rows", (len(plan.greedy), x.shape[1]), x.dtype))
            vals, ids = row_argmax(rows, None if bmax is None else bmax.index_select(0, g))
        else:
            vals, ids = (t.index_select(0, g) for t in row_argmax(x, bmax))
        tokens.index_copy_(0, g, ids)
        ok.index_copy_(0, g, torch.isfinite(vals))
        # Greedy rows' processed logits are fixed here: 7b must not change a greedy row's results.
        return x.index_select(0, plan.processed.index) if len(plan.processed) else None

    def _draw(
        self,
        x: torch.Tensor,
        plan: SamplingPlan,
        ws: Workspace,
        host: _HostRead,
        tokens: torch.Tensor,
        ok: torch.Tensor,
    ) -> _Drawn:
        """7c-7d for every random row; writes ``tokens`` and ``ok``.

        Both row groups first queue their small routing results (phase 1), which the first
        phase-2 ``host.get`` reads in one transfer.
        """
        u = uniforms(plan.random_rows, plan.generators, self.generator, x.device)
        nk = len(plan.topk)
        drawn = _Drawn()
        topk = self._topk_phase1(x, plan, host) if nk else None
        full = self._full_phase1(x, plan, ws, host) if len(plan.full) else None
        if topk is not None:
            tok, row_ok, drawn.topk = self._topk_phase2(x, plan, host, topk, u[:nk])
            tokens.index_copy_(0, plan.topk.index, tok)
            ok.index_copy_(0, plan.topk.index, row_ok)
        if full is not None:
            tok, row_ok = self._full_phase2(plan, ws, host, full, u[nk:], drawn)
            tokens.index_copy_(0, plan.full.index, tok)
            ok.index_copy_(0, plan.full.index, row_ok)
        return drawn

    @staticmethod
    def _topk_phase1(x: torch.Tensor, plan: SamplingPlan, host: _HostRead) -> _TopKRows:
        vals, ids = topk_candidates(x, plan.topk_kmax, rows=plan.topk.index)
        # Ties of -inf at the k-th place change nothing observable (they carry no mass).
        kth_finite = torch.isfinite(vals.gather(1, (plan.topk_k - 1)[:, None]).squeeze(1))
        return _TopKRows(vals, ids, host.add(ambiguous(vals, plan.topk_k) & kth_finite))

    @staticmethod
    def _topk_phase2(
        x: torch.Tensor, plan: SamplingPlan, host: _HostRead, pending: _TopKRows, u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, _Candidates]:
        """Exact top-k, then top-p over the renormalised candidates, then the draw among them."""
        kmax = plan.topk_kmax
        amb_rows = [i for i, a in enumerate(host.get(pending.ambiguous)) if a]
        vals, ids = resolve_topk(x, pending.vals, pending.ids, plan.topk_k, kmax, amb_rows, rows=plan.topk.index)
        in_k = torch.arange(kmax, device=x.device)[None, :] < plan.topk_k[:, None]
        q = torch.softmax(vals.masked_fill(~in_k, _NEG_INF), -1)
        perm = _order_by_prob(q, ids)
        ids, q, in_k = ids.gather(1, perm), q.gather(1, perm), in_k.gather(1, perm)
        keep = top_p_keep(q, plan.topk_p) & in_k
        col, row_ok = draw_weights(q * keep, u)
        return ids.gather(1, col[:, None]).squeeze(1), row_ok, _Candidates(ids, keep)

    @staticmethod
    def _full_phase1(x: torch.Tensor, plan: SamplingPlan, ws: Workspace, host: _HostRead) -> _FullRows:
        """Softmax of the full rows, their block sums, and the top-p probe of the top-p rows."""
        b, v = x.shape
        probs = ws.get("probs", (len(plan.full), v), torch.float32)
        if plan.full.rows == tuple(range(b)):
            torch.softmax(x, -1, out=probs)
        else:
            torch.softmax(torch.index_select(x, 0, plan.full.index, out=probs), -1, out=probs)
        bsum = row_block_sums(probs)
        totals = row_total(bsum.to(torch.float64))
        pending = _FullRows(probs, bsum, host.add((totals > 0) & torch.isfinite(totals)))
        if plan.n_top_p:
            ids, top, keep, hit = top_p_probe(probs[: plan.n_top_p], plan.top_p, totals[: plan.n_top_p])
            pending.probe, pending.probe_probs, pending.probe_hits = _Candidates(ids, keep), top, host.add(hit)
        return pending

    def _full_phase2(
        self, plan: SamplingPlan, ws: Workspace, host: _HostRead, pending: _FullRows, u: torch.Tensor, drawn: _Drawn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-p (probe hit, else histogram), then the two-level inverse-CDF draw."""
        ntp, probs, bsum = plan.n_top_p, pending.probs, pending.bsum
        valid = host.get(pending.valid)
        hits = host.get(pending.probe_hits) if ntp else []
        hist = tuple(i for i in range(ntp) if valid[i] and not hits[i])
        if hist:
            self._nucleus_by_histogram(probs, bsum, hist, plan, ws)
        tok, row_ok = draw_rows(probs, u, bsum)
        if any(hits):
            assert pending.probe is not None and pending.probe_probs is not None
            col, _ = draw_weights(pending.probe_probs * pending.probe.keep, u[:ntp])
            hit_t = torch.tensor(hits, dtype=torch.bool, device=probs.device)
            tok[:ntp] = torch.where(hit_t, pending.probe.ids.gather(1, col[:, None]).squeeze(1), tok[:ntp])
            drawn.probe, drawn.probe_hits = pending.probe, hits
        drawn.probs, drawn.histogram_rows = probs, hist
        return tok, row_ok

    @staticmethod
    def _nucleus_by_histogram(
        probs: torch.Tensor, bsum: torch.Tensor, rows: tuple[int, ...], plan: SamplingPlan, ws: Workspace
    ) -> None:
        """Top-p on full rows ``rows`` (local to ``probs``) in place; their block sums refreshed."""
        if rows == tuple(range(len(rows))):
            part = probs[: len(rows)]
            top_p_histogram_(part, plan.top_p[: len(rows)], ws)
            bsum[: len(rows)] = row_block_sums(part)
            return
        idx = torch.tensor(rows, device=probs.device)
        part = torch.index_select(probs, 0, idx, out=ws.get("histogram_rows", (len(rows), probs.shape[1]), probs.dtype))
        top_p_histogram_(part, plan.top_p.index_select(0, idx), ws)
        probs.index_copy_(0, idx, part)
        bsum.index_copy_(0, idx, row_block_sums(part))

    # -- step 8 ----------------------------------------------------------------------------

    @staticmethod
    def _logprob_topk_phase1(src: torch.Tensor, plan: SamplingPlan, host: _HostRead) -> _PendingTopK | None:
        k = min(plan.num_logprobs or 0, src.shape[1])
        if k <= 0:
            return None
        vals, ids = topk_candidates(src, k)
        kk = torch.full((src.shape[0],), k, dtype=torch.int64, device=src.device)
        return _PendingTopK(vals, ids, k, host.add(ambiguous(vals, kk)))

    def _logprobs(
        self,
        x: torch.Tensor,
        plan: SamplingPlan,
        ws: Workspace,
        host: _HostRead,
        tokens: torch.Tensor,
        raw: tuple[torch.Tensor, _PendingTopK | None] | None,
        greedy_processed: torch.Tensor | None,
        drawn: _Drawn | None,
    ) -> LogprobsTensors | None:
        if plan.num_logprobs is None:
            return None
        b, k = plan.batch_size, plan.num_logprobs
        ids_out = torch.full((b, k + 1), -1, dtype=torch.int64, device=x.device)
        ids_out[:, 0] = tokens
        lp_out = torch.full((b, k + 1), float("nan"), dtype=torch.float32, device=x.device)
        ranks = torch.full((b,), -1, dtype=torch.int64, device=x.device)
        sources = []
        if raw is not None:
            sources.append((plan.raw.index, *raw))
        if len(plan.processed):
            src = to_logprobs_(self._processed_logits(x, plan, greedy_processed, drawn), plan.processed_modes)
            sources.append((plan.processed.index, src, self._logprob_topk_phase1(src, plan, host)))
        for rows, src, pending in sources:
            lp, rank = sampled_logprob_and_rank(src, tokens.index_select(0, rows), ws)
            lp_out[rows, 0] = lp
            ranks[rows] = rank
            if pending is not None:
                kk = torch.full((src.shape[0],), pending.k, dtype=torch.int64, device=src.device)
                amb_rows = [i for i, a in enumerate(host.get(pending.handle)) if a]
                vals, ids = sort_by_value_then_id(
                    *resolve_topk(src, pending.vals, pending.ids, kk, pending.k, amb_rows)
                )
                lp_out[rows, 1 : 1 + pending.k] = vals
                ids_out[rows, 1 : 1 + pending.k] = ids
        return LogprobsTensors(ids_out, lp_out, ranks)

    @staticmethod
    def _processed_logits(
        x: torch.Tensor, plan: SamplingPlan, greedy_processed: torch.Tensor | None, drawn: _Drawn | None
    ) -> torch.Tensor:
        """Logits after 7c of the rows asking a processed mode: -inf where top-k/top-p removed a token.

        Opt-in and rare, so this walks those rows (device ops only, no host reads).
        """
        out = x.index_select(0, plan.processed.index)
        greedy = set(plan.greedy.rows)
        topk_pos = {r: i for i, r in enumerate(plan.topk.rows)}
        full_pos = {r: i for i, r in enumerate(plan.full.rows)}
        for local, r in enumerate(plan.processed.rows):
            if r in greedy:
                assert greedy_processed is not None
                out[local] = greedy_processed[local]
                continue
            assert drawn is not None
            cand: _Candidates | None = None
            i = -1
            if r in topk_pos:
                cand, i = drawn.topk, topk_pos[r]
            elif drawn.probe_hits is not None and full_pos[r] < plan.n_top_p and drawn.probe_hits[full_pos[r]]:
                cand, i = drawn.probe, full_pos[r]
            if cand is not None:
                kept = torch.where(cand.keep[i], x[r, cand.ids[i]], _NEG_INF)
                out[local] = _NEG_INF
                out[local, cand.ids[i]] = kept
            elif full_pos[r] in drawn.histogram_rows:
                assert drawn.probs is not None
                out[local] = torch.where(drawn.probs[full_pos[r]] > 0, out[local], _NEG_INF)
        return out

"""The built-in processors, on the same programming model as custom ones (docs/sampling.md "Built-in processors").

Each keeps per-request settings in a ``RowStates`` (only rows that enabled it), rebuilds its
dense device tensors only when those rows changed (or the vocabulary width did), stages host
data through pinned memory when allowed, and returns its input untouched when no row is active.
Registry order gives the pipeline order: AllowedTokenIds (step 3), BadWords (4), MinTokens and
LogitBias (5), MinP (7b, argmax-invariant).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from worker.logits_processor.interface import BatchUpdate, LogitsProcessor
from worker.logits_processor.state import RowStates
from worker.ops.cutoff import drop_below_
from worker.ops.plan import RowGroup, runs_of
from worker.ops.scratch import Buffer
from worker.ops.staging import stage
from worker.sampling_params import SamplingParams

_NEG_INF = float("-inf")
_F32_MAX = torch.finfo(torch.float32).max
T = TypeVar("T")


class _SparseRows(LogitsProcessor, Generic[T]):
    """Shared plumbing: a RowStates of per-row settings and a 'dense tensors are stale' flag."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.is_pin_memory = is_pin_memory
        self.states: RowStates[T] = RowStates(self._state)
        self._built_for: int | None = None  # vocab width the dense tensors were built for

    def _state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> T | None:
        raise NotImplementedError

    def _rebuild(self, vocab_size: int) -> None:
        raise NotImplementedError

    @property
    def has_active_rows(self) -> bool:
        return bool(self.states)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if self.states.update(batch_update):
            self._built_for = None

    def _ensure_built(self, vocab_size: int) -> None:
        if self._built_for != vocab_size:
            self._rebuild(vocab_size)
            self._built_for = vocab_size

    def _stage(self, values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return stage(values, dtype, self.device, self.is_pin_memory)

    def is_argmax_invariant(self) -> bool:
        return False


def _pairs(rows_and_ids: list[tuple[int, tuple[int, ...]]]) -> tuple[list[int], list[int]]:
    rows = [r for r, ids in rows_and_ids for _ in ids]
    ids = [t for _, ids_ in rows_and_ids for t in ids_]
    return rows, ids


class AllowedTokenIdsLogitsProcessor(_SparseRows[tuple[int, ...]]):
    """Step 3: rows with ``allowed_token_ids`` keep only those ids; every other logit is -inf.

    Applied as fill-and-restore: save the allowed logits, fill the active rows with -inf,
    write the saved values back. Cost is one row fill plus the allowed ids, no [rows, V] mask.
    """

    def _state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> tuple[int, ...] | None:
        if params.allowed_token_ids is None:
            return None
        return tuple(sorted(set(params.allowed_token_ids)))

    def _rebuild(self, vocab_size: int) -> None:
        items = list(self.states.items())
        rows, ids = _pairs(items)
        self._rows = self._stage([r for r, _ in items], torch.int64)
        self._at = (self._stage(rows, torch.int64), self._stage(ids, torch.int64))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        kept = logits[self._at]
        logits.index_fill_(0, self._rows, _NEG_INF)
        logits[self._at] = kept
        return logits


@dataclass(frozen=True)
class _BadWords:
    always: tuple[int, ...]  # one-token words: banned at every step
    prefixed: tuple[tuple[int, ...], ...]  # longer words: last token banned after the prefix
    output: list[int]  # live


class BadWordsLogitsProcessor(_SparseRows[_BadWords]):
    """Step 4: ban a word's last token when the row's last n-1 output tokens equal its first n-1.

    Reads ``params.bad_words_token_ids`` (both the bare and the leading-space forms, filled by
    the engine). One-token words are staged once per batch change; longer words are checked
    against the live output list every step (sparse: only rows with bad words).
    """

    def _state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _BadWords | None:
        words = [tuple(w) for w in params.bad_words_token_ids if w]
        if not words:
            return None
        always = tuple(sorted({w[0] for w in words if len(w) == 1}))
        prefixed = tuple(w for w in words if len(w) > 1)
        return _BadWords(always, prefixed, output_ids)

    def _rebuild(self, vocab_size: int) -> None:
        rows, ids = _pairs([(r, s.always) for r, s in self.states.items()])
        self._always = (self._stage(rows, torch.int64), self._stage(ids, torch.int64))
        self._prefixed = [(r, s) for r, s in self.states.items() if s.prefixed]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        if self._always[0].numel():
            logits[self._always] = _NEG_INF
        rows: list[int] = []
        ids: list[int] = []
        for row, s in self._prefixed:
            out = s.output
            for word in s.prefixed:
                n = len(word) - 1
                if len(out) >= n and tuple(out[len(out) - n :]) == word[:-1]:
                    rows.append(row)
                    ids.append(word[-1])
        if rows:
            logits[self._stage(rows, torch.int64), self._stage(ids, torch.int64)] = _NEG_INF
        return logits


@dataclass(frozen=True)
class _MinTokens:
    min_tokens: int
    stop_ids: tuple[int, ...]
    output: list[int]  # live


class MinTokensLogitsProcessor(_SparseRows[_MinTokens]):
    """Step 5: while ``len(output) < min_tokens`` every stop token id (EOS included) is -inf.

    A stop token may appear at position ``min_tokens``. The set of rows still below their
    minimum is re-read from the live output lists each step; indices are restaged only when it
    changes.
    """

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)
        self._active: tuple[int, ...] | None = None

    def _state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _MinTokens | None:
        stops = tuple(sorted(params.all_stop_token_ids))
        if params.min_tokens <= 0 or not stops:
            return None
        return _MinTokens(params.min_tokens, stops, output_ids)

    def _rebuild(self, vocab_size: int) -> None:
        self._active = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        active = tuple(r for r, s in self.states.items() if len(s.output) < s.min_tokens)
        if not active:
            return logits
        if active != self._active:
            rows, ids = _pairs([(r, self.states[r].stop_ids) for r in active])
            self._at = (self._stage(rows, torch.int64), self._stage(ids, torch.int64))
            self._active = active
        logits[self._at] = _NEG_INF
        return logits


class LogitBiasLogitsProcessor(_SparseRows[tuple[tuple[int, ...], tuple[float, ...]]]):
    """Step 5: ``logits[row, tok] += bias`` for every (token, bias) of the row's ``logit_bias``."""

    def _state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        if not params.logit_bias:
            return None
        toks = tuple(sorted(params.logit_bias))
        return toks, tuple(float(params.logit_bias[t]) for t in toks)

    def _rebuild(self, vocab_size: int) -> None:
        items = list(self.states.items())
        rows, toks = _pairs([(r, s[0]) for r, s in items])
        # Clamped to float32's finite range: a huge bias (gRPC does not clamp to +-100) must not
        # become inf, whose sum with a banned token's -inf would be NaN.
        biases = [min(max(b, -_F32_MAX), _F32_MAX) for _, s in items for b in s[1]]
        self._at = (self._stage(rows, torch.int64), self._stage(toks, torch.int64))
        self._bias = self._stage(biases, torch.float32)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        logits.index_put_(self._at, self._bias.to(logits.dtype), accumulate=True)
        return logits


class MinPLogitsProcessor(_SparseRows[float]):
    """Step 7b (after temperature): drop tokens whose probability is below ``min_p * max_prob``.

    Done in logit space, without a softmax: ``x < rowmax + log(min_p)`` becomes -inf, with
    ``log(min_p)`` computed once in float64 on the host and rounded to float32. Greedy rows
    are never enabled. Argmax-invariant: the row max always survives.
    """

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)
        self._diff = Buffer()

    def is_argmax_invariant(self) -> bool:
        return True

    def _state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> float | None:
        if params.is_greedy or params.min_p <= 0.0:
            return None
        return float(params.min_p)

    def _rebuild(self, vocab_size: int) -> None:
        items = list(self.states.items())
        rows = [r for r, _ in items]
        self._rows = RowGroup(tuple(rows), self._stage(rows, torch.int64), runs_of(rows))
        self._log_min_p = self._stage([math.log(m) for _, m in items], torch.float32)[:, None]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        threshold = torch.empty(len(self._rows), 1, dtype=logits.dtype, device=logits.device)
        for run in self._rows.runs:  # the active rows in place, a stretch of consecutive rows at a time
            sub, local = logits[run.batch : run.batch + run.length], slice(run.local, run.local + run.length)
            torch.add(sub.amax(-1, keepdim=True), self._log_min_p[local].to(sub.dtype), out=threshold[local])
        drop_below_(logits, self._rows, threshold, self._diff)
        return logits

"""DRY, "don't repeat yourself" (llama.cpp's ``llama_sampler_dry``), over prompt + output.

A token that would extend a repeat of the text's own ending is penalised: when the last ``L``
tokens (``L >= dry_allowed_length``) also occur earlier followed by token ``t``, then
``logit[t] -= dry_multiplier * dry_base ** (L - dry_allowed_length)`` with the longest such
``L`` per token (the exponent clamped so the power stays finite in float32). Repeats never reach
back past the most recent sequence breaker (a token sequence; the longest one starting at the
latest breaker start wins) nor past the last ``dry_penalty_last_n`` tokens (-1 = all, 0 = off),
and a single-token breaker is never penalised itself. Breakers are token-id sequences: the
processor has no tokenizer (llama.cpp tokenizes its default strings ``\\n : " *``).

Vectorised: ``L(j)``, the length of the longest suffix of the text that also ends at position
``j``, is kept per request in a dense ``[slots, capacity]`` buffer. A new token ``x`` at
position ``t`` updates every row at once: ``L(j) = L(j-1) + 1 if text[j] == x else 0`` (one
pass, no per-row loop); a request's first step fills its row with the Z-algorithm on its
reversed text (llama.cpp's own method). Rows own a slot that moves with their state, so
BatchUpdate moves never touch the buffers. Not argmax-invariant (step 5); acts on greedy rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import torch
from pydantic import Field

from worker.logits_processor.library.base import LibraryProcessor
from worker.logits_processor.schema import ExtraArgs
from worker.sampling_params import SamplingParams

_FLOAT_MAX_LOG = 88.7228391  # ~log(float32 max), as llama.cpp

Breaker = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=16)]


class DRYArgs(ExtraArgs):
    dry_multiplier: float = Field(ge=0.0, le=100.0, description="Penalty scale; 0 = off.")
    dry_base: float = Field(1.75, ge=1.0, le=100.0, description="Growth of the penalty per extra repeated token.")
    dry_allowed_length: int = Field(2, ge=1, le=65536, description="Repeats up to this long are free.")
    dry_penalty_last_n: int = Field(-1, ge=-1, description="Look back this many tokens; -1 = all, 0 = off.")
    dry_sequence_breakers: list[Breaker] = Field(
        default_factory=list, max_length=64, description="Token-id sequences that repeats never cross."
    )


@dataclass
class _Row:
    multiplier: float
    base: float
    allowed: int
    last_n: int
    by_last: dict[int, list[tuple[int, ...]]]  # breakers by their last token
    singles: frozenset[int]  # one-token breakers: never penalised
    prompt: list[int]
    output: list[int]  # live
    slot: int
    done: int = 0  # tokens of the text already in the slot's buffers
    breaker: tuple[int, int] = (-1, 0)  # (start, length) of the breaker that limits repeats

    def total(self) -> int:
        return len(self.prompt) + len(self.output)

    def token(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]

    def note(self, end: int) -> None:
        """Track the latest-starting breaker among those ending at ``end``."""
        for b in self.by_last.get(self.token(end), ()):
            start = end - len(b) + 1
            if (
                start >= 0
                and (start, len(b)) > self.breaker
                and all(self.token(start + i) == b[i] for i in range(len(b) - 1))
            ):
                self.breaker = (start, len(b))

    def window(self) -> tuple[int, int]:
        """(first position looked at, repeat-length limit) for the current text."""
        n = self.total()
        ws = max(0, n - self.last_n) if self.last_n > 0 else 0
        start, length = self.breaker
        return ws, (n - start - length) if start >= ws else n - ws

    def max_exponent(self) -> int:
        return int(_FLOAT_MAX_LOG / math.log(self.base)) if self.base > 1.000001 else 0

    def penalty(self, repeat: int) -> float:
        exp, cap = repeat - self.allowed, self.max_exponent()
        return self.multiplier * self.base ** (min(exp, cap) if cap > 0 else exp)


def suffix_matches(text: list[int]) -> list[int]:
    """``L(j)`` for every ``j`` (0 at the last position): the Z-algorithm on the reversed text."""
    s, n = text[::-1], len(text)
    z = [0] * n
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and s[z[i]] == s[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    return [z[n - 1 - j] if j < n - 1 else 0 for j in range(n)]


class DRYLogitsProcessor(LibraryProcessor[_Row, DRYArgs]):
    """``extra_args={"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2}``."""

    extra_args_model = DRYArgs
    acts_on_greedy = True

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)
        self._text = torch.zeros(0, 0, dtype=torch.int64, device=self.device)
        self._match = torch.zeros(0, 0, dtype=torch.int32, device=self.device)
        self._free: list[int] = []
        self._slots = 0

    def _row_state(
        self, args: DRYArgs, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _Row | None:
        if args.dry_multiplier == 0.0 or args.dry_penalty_last_n == 0:
            return None
        by_last: dict[int, list[tuple[int, ...]]] = {}
        for b in args.dry_sequence_breakers:
            by_last.setdefault(b[-1], []).append(tuple(b))
        singles = frozenset(b[0] for b in args.dry_sequence_breakers if len(b) == 1)
        slot = self._free.pop() if self._free else self._new_slot()
        return _Row(
            float(args.dry_multiplier),
            float(args.dry_base),
            int(args.dry_allowed_length),
            int(args.dry_penalty_last_n),
            by_last,
            singles,
            list(prompt_ids or []),
            output_ids,
            slot,
        )

    def _new_slot(self) -> int:
        self._slots += 1
        return self._slots - 1

    def _rebuild_rows(self, items: list[tuple[int, _Row]]) -> None:
        live = {s.slot for _, s in items}
        self._free = sorted(set(range(self._slots)) - live, reverse=True)  # a dropped row's slot is free again
        self._slot_index = self._stage([s.slot for _, s in items], torch.int64)

    def _fit(self, length: int) -> None:
        rows, cap = self._text.shape
        if rows >= self._slots and cap >= length:
            return
        rows, cap = max(rows, self._slots), max(cap, 256)
        while cap < length:
            cap *= 2
        text = torch.zeros(rows, cap, dtype=torch.int64, device=self.device)
        match = torch.zeros(rows, cap, dtype=torch.int32, device=self.device)
        text[: self._text.shape[0], : self._text.shape[1]] = self._text
        match[: self._match.shape[0], : self._match.shape[1]] = self._match
        self._text, self._match = text, match

    def _advance(self, rows: list[_Row]) -> None:
        """Bring every row's buffers up to its current text."""
        self._fit(max(s.total() for s in rows))
        for s in rows:
            if s.done == 0 and s.total():  # first step: the whole text at once
                tokens = [s.token(i) for i in range(s.total())]
                self._text[s.slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
                self._match[s.slot, : len(tokens)] = torch.tensor(suffix_matches(tokens), dtype=torch.int32)
                for end in range(len(tokens)):
                    s.note(end)
                s.done = len(tokens)
        while behind := [s for s in rows if s.done < s.total()]:  # usually one token, all rows at once
            slots = self._stage([s.slot for s in behind], torch.int64)
            pos = self._stage([s.done for s in behind], torch.int64)
            new = self._stage([s.token(s.done) for s in behind], torch.int64)
            text, match = self._text[slots], self._match[slots]
            cols = torch.arange(text.shape[1], device=self.device)
            extend = (text == new[:, None]) & (cols < pos[:, None])
            shifted = torch.cat([torch.ones_like(match[:, :1]), match[:, :-1] + 1], dim=1)
            self._match[slots] = torch.where(extend, shifted, 0).to(torch.int32)
            self._text[slots, pos] = new
            for s in behind:
                s.note(s.done)
                s.done += 1

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        states = [s for _, s in self.states.items()]
        self._advance(states)
        windows = [s.window() for s in states]
        start = self._stage([w[0] for w in windows], torch.int64)[:, None]
        limit = self._stage([w[1] for w in windows], torch.int64)[:, None]
        last = self._stage([s.total() - 2 for s in states], torch.int64)[:, None]  # the last j with a next token
        allowed = self._stage([s.allowed for s in states], torch.int64)[:, None]
        match = self._match[self._slot_index].to(torch.int64)
        cols = torch.arange(match.shape[1], device=self.device)
        repeat = torch.minimum(torch.minimum(match, cols - start + 1), limit)
        hit = (repeat >= allowed) & (cols >= start) & (cols <= last)
        local, j = hit.nonzero(as_tuple=True)
        if not local.numel():
            return logits
        v = logits.shape[1]
        nxt = self._text[self._slot_index[local], j + 1]
        keys, inverse = torch.unique(local * v + nxt, return_inverse=True)
        longest = torch.zeros(keys.shape, dtype=torch.int64, device=self.device)
        longest.scatter_reduce_(0, inverse, repeat[local, j], "amax")
        rows, toks, pens = [], [], []
        for key, length in zip(keys.tolist(), longest.tolist()):
            i, tok = divmod(key, v)
            s = states[i]
            if tok not in s.singles:
                rows.append(self._row_list[i])
                toks.append(tok)
                pens.append(-s.penalty(length))
        if rows:
            at = (self._stage(rows, torch.int64), self._stage(toks, torch.int64))
            logits.index_put_(at, self._stage(pens, torch.float32).to(logits.dtype), accumulate=True)
        return logits

    def is_argmax_invariant(self) -> bool:
        return False

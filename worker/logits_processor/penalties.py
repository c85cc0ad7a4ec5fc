"""Step 6: repetition, frequency and presence penalties as a processor (SPEC §2.4).

Repetition divides positive logits by ``r`` (multiplies the others) over every token the row
has seen, prompt or output; then frequency and presence subtract over OUTPUT tokens only:
``x -= f * count``, ``x -= p * (count > 0)``. Only seen (row, token) pairs are touched. The
prompt's distinct tokens are computed once per request, the flat prompt keys once per batch
change; the output part is read from the live lists every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from worker.logits_processor.builtin import _SparseRows
from worker.ops.penalties import apply_frequency_presence_, apply_repetition_
from worker.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Penalties:
    repetition: float
    frequency: float
    presence: float
    prompt_tokens: torch.Tensor  # distinct prompt ids (CPU int64); empty unless repetition != 1
    output: list[int]  # live


class PenaltiesLogitsProcessor(_SparseRows[_Penalties]):
    """Repetition / frequency / presence penalties; not argmax-invariant."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)

    def _state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _Penalties | None:
        if not params.uses_penalties:
            return None
        rep = float(params.repetition_penalty)
        prompt = torch.tensor(prompt_ids or [], dtype=torch.int64)
        prompt = torch.unique(prompt) if rep != 1.0 else prompt[:0]
        return _Penalties(rep, float(params.frequency_penalty), float(params.presence_penalty), prompt, output_ids)

    def _rebuild(self, vocab_size: int) -> None:
        items = list(self.states.items())
        self._items = items
        self._rows = self._stage([r for r, _ in items], torch.int64)
        self._rep = self._stage([s.repetition for _, s in items], torch.float32)
        self._freq = self._stage([s.frequency for _, s in items], torch.float32)
        self._pres = self._stage([s.presence for _, s in items], torch.float32)
        uses_rep = [s.repetition != 1.0 for _, s in items]
        self._uses_rep = self._stage(uses_rep, torch.bool)
        self._any_rep = any(uses_rep)
        self._any_fp = any(s.frequency != 0.0 or s.presence != 0.0 for _, s in items)
        keys = [s.prompt_tokens + i * vocab_size for i, (_, s) in enumerate(items) if s.prompt_tokens.numel()]
        host = torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64)
        self._prompt_keys = self._stage(host, torch.int64)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        v = logits.shape[1]
        self._ensure_built(v)
        outputs = [s.output for _, s in self._items]
        lengths = [len(o) for o in outputs]
        local = torch.repeat_interleave(torch.arange(len(outputs)), torch.tensor(lengths, dtype=torch.int64))
        host_keys = local * v + torch.tensor(list(chain.from_iterable(outputs)), dtype=torch.int64)
        out_keys = self._stage(host_keys, torch.int64)
        if self._any_rep:
            rep_out = out_keys[self._uses_rep[out_keys // v]]
            seen = torch.unique(torch.cat([self._prompt_keys, rep_out]))
            apply_repetition_(logits, self._rows, self._rep, seen)
        if self._any_fp:
            apply_frequency_presence_(logits, self._rows, self._freq, self._pres, out_keys)
        return logits

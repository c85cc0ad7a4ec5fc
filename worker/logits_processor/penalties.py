"""Step 6: repetition, frequency and presence penalties as a processor (docs/sampling.md "The nine steps").

Repetition divides positive logits by ``r`` (multiplies the others) over every token the row
has seen, prompt or output; then frequency and presence subtract over OUTPUT tokens only:
``x -= f * count``, ``x -= p * (count > 0)``. Only seen (row, token) pairs are touched. The
prompt's distinct tokens are computed once per request, the flat prompt keys once per batch
change; the output part is read from the live lists every step. Keys are made distinct on the
host, where the lists are, so the device never waits on a ``unique``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from worker.logits_processor.builtin import _SparseRows
from worker.ops.penalties import apply_frequency_presence_, apply_repetition_, seen_keys
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
        # Clamped into float32's positive finite range: 1e-300 would round to 0 (and -inf * 0 is
        # NaN), 1e300 to inf (0 * inf is NaN). A clamped tiny penalty may still overflow x / r to
        # +inf, which the sampler treats as forcing those tokens (docs/sampling.md "The nine steps").
        f32 = torch.finfo(torch.float32)
        self._rep = self._stage([min(max(s.repetition, f32.tiny), f32.max) for _, s in items], torch.float32)
        self._freq = self._stage([s.frequency for _, s in items], torch.float32)
        self._pres = self._stage([s.presence for _, s in items], torch.float32)
        uses_rep = [s.repetition != 1.0 for _, s in items]
        self._uses_rep = torch.tensor(uses_rep, dtype=torch.bool)  # host: keys are built there
        self._any_rep = any(uses_rep)
        self._any_fp = any(s.frequency != 0.0 or s.presence != 0.0 for _, s in items)
        keys = [s.prompt_tokens + i * vocab_size for i, (_, s) in enumerate(items) if s.prompt_tokens.numel()]
        # Sorted and distinct: rows are in order and each row's ids come from torch.unique.
        self._prompt_keys = torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        v = logits.shape[1]
        self._ensure_built(v)
        outputs = [s.output for _, s in self._items]
        lengths = torch.tensor([len(o) for o in outputs], dtype=torch.int64)
        local = torch.repeat_interleave(torch.arange(len(outputs)), lengths)
        out_keys = local * v + torch.tensor(list(chain.from_iterable(outputs)), dtype=torch.int64)
        if self._any_rep:
            seen = seen_keys(self._prompt_keys, out_keys[self._uses_rep[local]])
            apply_repetition_(logits, self._rows, self._rep, self._stage(seen, torch.int64))
        if self._any_fp:
            keys, counts = torch.unique(out_keys, return_counts=True)
            apply_frequency_presence_(
                logits,
                self._rows,
                self._freq,
                self._pres,
                self._stage(keys, torch.int64),
                self._stage(counts, torch.int64),
            )
        return logits

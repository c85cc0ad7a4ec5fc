"""Epsilon sampling (Hewitt et al. 2022), transformers' ``EpsilonLogitsWarper``: drop ``p < epsilon``.

The row's top token always stays, so it is argmax-invariant: step 7b, after temperature.
"""

from __future__ import annotations

import torch
from pydantic import Field

from worker.logits_processor.library.base import LibraryProcessor, drop_below
from worker.logits_processor.schema import ExtraArgs
from worker.sampling_params import SamplingParams


class EpsilonArgs(ExtraArgs):
    epsilon_cutoff: float = Field(ge=0.0, lt=1.0, description="Drop tokens with p < epsilon_cutoff; 0 = off.")


class EpsilonLogitsProcessor(LibraryProcessor[float, EpsilonArgs]):
    """``extra_args={"epsilon_cutoff": 3e-4}`` on a sampled request."""

    extra_args_model = EpsilonArgs

    def _row_state(
        self, args: EpsilonArgs, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> float | None:
        return float(args.epsilon_cutoff) if args.epsilon_cutoff > 0.0 else None

    def _rebuild_rows(self, items: list[tuple[int, float]]) -> None:
        self._eps = self._stage([e for _, e in items], torch.float32)[:, None]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        sub = self.gather(logits)
        drop_below(sub, torch.softmax(sub, dim=-1), self._eps.to(sub.dtype))
        return self.scatter(logits, sub)

    def is_argmax_invariant(self) -> bool:
        return True

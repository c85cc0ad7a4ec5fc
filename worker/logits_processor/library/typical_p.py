"""Locally typical sampling (Meier et al. 2022), transformers' ``TypicalLogitsWarper`` formula.

Per row: entropy ``H`` of the distribution; tokens sorted by ``|-log p - H|`` ascending; keep the
shortest prefix whose mass reaches ``typical_p`` (and every token tied with its last one).
Not argmax-invariant (the most probable token can be atypical), so it runs at step 5 on the
logits before temperature, llama.cpp's place for it. Greedy rows are left alone.
"""

from __future__ import annotations

import torch
from pydantic import Field

from worker.logits_processor.library.base import NEG_INF, LibraryProcessor
from worker.logits_processor.schema import ExtraArgs
from worker.sampling_params import SamplingParams


class TypicalPArgs(ExtraArgs):
    typical_p: float = Field(gt=0.0, le=1.0, description="Mass of the locally typical set; 1.0 = off.")


class TypicalPLogitsProcessor(LibraryProcessor[float, TypicalPArgs]):
    """``extra_args={"typical_p": 0.9}`` on a sampled request."""

    extra_args_model = TypicalPArgs

    def _row_state(
        self, args: TypicalPArgs, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> float | None:
        return None if args.typical_p >= 1.0 else float(args.typical_p)

    def _rebuild_rows(self, items: list[tuple[int, float]]) -> None:
        self._mass = self._stage([m for _, m in items], torch.float32)[:, None]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        sub = self.gather(logits)
        normalized = torch.log_softmax(sub, dim=-1)
        ent = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
        shifted = torch.abs(-normalized - ent)
        sorted_scores, sorted_indices = torch.sort(shifted, descending=False)
        cumulative = sub.gather(-1, sorted_indices).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < self._mass.to(cumulative.dtype)).sum(dim=1).clamp_(max=sub.shape[1] - 1)
        # Removing by shifted score > the last kept one's equals transformers' scatter of the sorted mask.
        sub.masked_fill_(shifted > sorted_scores.gather(1, last[:, None]), NEG_INF)
        return self.scatter(logits, sub)

    def is_argmax_invariant(self) -> bool:
        return False

"""Top-a sampling: drop tokens whose probability is below ``top_a * max_prob ** 2``.

The rule of text-generation-webui / KoboldAI. Argmax-invariant (``max_prob >= a * max_prob**2``
for ``a <= 1``), so it runs at step 7b after temperature and is skipped for all-greedy batches.
"""

from __future__ import annotations

import torch
from pydantic import Field

from worker.logits_processor.library.base import NEG_INF, LibraryProcessor
from worker.logits_processor.schema import ExtraArgs
from worker.sampling_params import SamplingParams


class TopAArgs(ExtraArgs):
    top_a: float = Field(ge=0.0, le=1.0, description="Drop p < top_a * max_p**2; 0 = off.")


class TopALogitsProcessor(LibraryProcessor[float, TopAArgs]):
    """``extra_args={"top_a": 0.2}`` on a sampled request."""

    extra_args_model = TopAArgs

    def _row_state(
        self, args: TopAArgs, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> float | None:
        return float(args.top_a) if args.top_a > 0.0 else None

    def _rebuild_rows(self, items: list[tuple[int, float]]) -> None:
        self._a = self._stage([a for _, a in items], torch.float32)[:, None]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        sub = self.gather(logits)
        probs = torch.softmax(sub, dim=-1)
        limit = probs.amax(-1, keepdim=True).square_().mul_(self._a.to(probs.dtype))
        sub.masked_fill_(probs < limit, NEG_INF)
        return self.scatter(logits, sub)

    def is_argmax_invariant(self) -> bool:
        return True

"""Eta sampling (Hewitt et al. 2022), transformers' ``EtaLogitsWarper``.

Drop ``p < min(eta, sqrt(eta) * exp(-H))`` where ``H`` is the row's entropy; the top token
always stays, so it is argmax-invariant: step 7b, after temperature.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from worker.logits_processor.library.base import LibraryProcessor, drop_below
from worker.logits_processor.schema import ExtraArgs
from worker.sampling_params import SamplingParams


class EtaArgs(ExtraArgs):
    eta_cutoff: float = Field(ge=0.0, lt=1.0, description="eta of eta sampling; 0 = off.")


class EtaLogitsProcessor(LibraryProcessor[float, EtaArgs]):
    """``extra_args={"eta_cutoff": 3e-4}`` on a sampled request."""

    extra_args_model = EtaArgs

    def _row_state(
        self, args: EtaArgs, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> float | None:
        return float(args.eta_cutoff) if args.eta_cutoff > 0.0 else None

    def _rebuild_rows(self, items: list[tuple[int, float]]) -> None:
        self._eta = self._stage([e for _, e in items], torch.float32)[:, None]
        self._sqrt_eta = self._stage([math.sqrt(e) for _, e in items], torch.float32)[:, None]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        sub = self.gather(logits)
        logp = torch.log_softmax(sub, dim=-1)
        probs = logp.exp()
        # As torch.distributions.Categorical.entropy: -inf log-probs count as the dtype's min.
        entropy = -(logp.clamp(min=torch.finfo(logp.dtype).min) * probs).sum(-1, keepdim=True)
        cutoff = torch.minimum(self._eta.to(sub.dtype), self._sqrt_eta.to(sub.dtype) * torch.exp(-entropy))
        drop_below(sub, probs, cutoff)
        return self.scatter(logits, sub)

    def is_argmax_invariant(self) -> bool:
        return True

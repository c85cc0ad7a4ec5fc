"""Mirostat v2 (Basu et al. 2021), llama.cpp's ``llama_sampler_mirostat_v2``.

Per request, a running target ``mu`` (starts at ``2 * tau``): each step, tokens whose surprise
``-log2 p`` exceeds ``mu`` are removed (the top token always stays); after the token is drawn,
``mu -= eta * (surprise(token) - tau)``, the surprise measured on the truncated, renormalised
distribution. The drawn token is read at the next step from the request's live output list;
the truncated log-probs of each row are kept until then, in the row's state, so state follows
the batch through ``BatchUpdate``. A token that distribution gave no mass (it was not drawn from
it) leaves ``mu`` unchanged. Argmax-invariant: step 7b, after temperature; greedy rows are left
alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field

from worker.logits_processor.library.base import NEG_INF, LibraryProcessor
from worker.logits_processor.schema import ExtraArgs
from worker.sampling_params import SamplingParams

_LN2 = math.log(2.0)


class MirostatArgs(ExtraArgs):
    mirostat: Literal[0, 2] = Field(description="2 = mirostat v2 (llama.cpp's key); 0 = off.")
    mirostat_tau: float = Field(5.0, gt=0.0, le=100.0, description="Target surprise in bits.")
    mirostat_eta: float = Field(0.1, ge=0.0, le=10.0, description="Learning rate of mu.")


@dataclass
class _Row:
    tau: float
    eta: float
    mu: float
    output: list[int]  # live
    seen: int = -1  # len(output) when `logp` was computed; -1: no step yet
    logp: torch.Tensor | None = None  # [V] truncated, renormalised log-probs of that step


class MirostatLogitsProcessor(LibraryProcessor[_Row, MirostatArgs]):
    """``extra_args={"mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1}`` on a sampled request."""

    extra_args_model = MirostatArgs

    def _row_state(
        self, args: MirostatArgs, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _Row | None:
        if args.mirostat != 2:
            return None
        return _Row(float(args.mirostat_tau), float(args.mirostat_eta), 2.0 * float(args.mirostat_tau), output_ids)

    def _learn(self) -> None:
        """Update ``mu`` of every row whose previous step's token has arrived (one host read)."""
        pending = [s for _, s in self.states.items() if s.logp is not None and len(s.output) > s.seen]
        if not pending:
            return
        logps = torch.stack([s.logp[s.output[s.seen]] for s in pending if s.logp is not None]).tolist()
        for s, lp in zip(pending, logps):
            if math.isfinite(lp):
                s.mu -= s.eta * (-lp / _LN2 - s.tau)
            s.logp = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        self._learn()
        states = [s for _, s in self.states.items()]
        sub = self.gather(logits)
        logp = torch.log_softmax(sub, dim=-1)
        floor = self._stage([-s.mu * _LN2 for s in states], torch.float32)[:, None].to(logp.dtype)
        keep = logp >= floor
        # The top token has the highest log-prob: if it is kept nothing changes; if not, no
        # token is, and it alone stays (llama.cpp keeps one).
        keep.scatter_(1, logp.argmax(-1, keepdim=True), True)
        sub.masked_fill_(~keep, NEG_INF)
        kept = torch.log_softmax(sub, dim=-1)
        for i, s in enumerate(states):
            s.logp, s.seen = kept[i], len(s.output)
        return self.scatter(logits, sub)

    def is_argmax_invariant(self) -> bool:
        return True

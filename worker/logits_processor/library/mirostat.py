"""Mirostat v2 (Basu et al. 2021), llama.cpp's ``llama_sampler_mirostat_v2``.

Per request, a running target ``mu`` (starts at ``2 * tau``): each step, tokens whose surprise
``-log2 p`` exceeds ``mu`` are removed (the top token always stays); after the token is drawn,
``mu -= eta * (surprise(token) - tau)``, the surprise measured on the truncated, renormalised
distribution. The drawn token is read at the next step from the request's live output list;
each row's truncated logits and their logsumexp are kept until then, in the row's state, so
state follows the batch through ``BatchUpdate``. A token that distribution gave no mass (it was
not drawn from it) leaves ``mu`` unchanged. Argmax-invariant: step 7b, after temperature; greedy
rows are left alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

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
    seen: int = -1  # len(output) when `kept` was computed; -1: no step yet
    kept: torch.Tensor | None = None  # [V] that step's truncated logits (-inf = removed)
    lse: torch.Tensor | None = None  # their logsumexp: log p(token) = kept[token] - lse


class MirostatLogitsProcessor(LibraryProcessor[_Row]):
    """``extra_args={"mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1}`` on a sampled request."""

    extra_args_model = MirostatArgs

    def _row_state(self, args: Any, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _Row | None:
        if args.mirostat != 2:
            return None
        return _Row(float(args.mirostat_tau), float(args.mirostat_eta), 2.0 * float(args.mirostat_tau), output_ids)

    def _learn(self) -> None:
        """Update ``mu`` of every row whose previous step's token has arrived (one host read)."""
        pending = [s for _, s in self.states.items() if s.kept is not None and len(s.output) > s.seen]
        if not pending:
            return
        logps = torch.stack([s.kept[s.output[s.seen]] - s.lse for s in pending]).tolist()  # type: ignore[index,operator]
        for s, lp in zip(pending, logps):
            if math.isfinite(lp):
                s.mu -= s.eta * (-lp / _LN2 - s.tau)
            s.kept = s.lse = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        self._learn()
        states = [s for _, s in self.states.items()]
        sub = self.gather(logits)
        # Surprise -log2 p <= mu  <=>  x >= logsumexp(x) - mu * ln 2: one exp pass, no log pass.
        floor = self._stage([-s.mu * _LN2 for s in states], torch.float32)[:, None].to(sub.dtype)
        keep = sub >= torch.logsumexp(sub, dim=-1, keepdim=True) + floor
        # The top token has the highest logit: if it is kept nothing changes; if not, no token
        # is, and it alone stays (llama.cpp keeps one; the lowest id among tied ones).
        keep.scatter_(1, sub.argmax(-1, keepdim=True), True)
        sub.masked_fill_(~keep, NEG_INF)
        kept = sub.clone()  # later steps of the sampler write into sub
        lse = torch.logsumexp(kept, dim=-1)
        for i, s in enumerate(states):
            s.kept, s.lse, s.seen = kept[i], lse[i], len(s.output)
        return self.scatter(logits, sub)

    def is_argmax_invariant(self) -> bool:
        return True

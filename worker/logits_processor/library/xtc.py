"""XTC, "exclude top choices" (llama.cpp's ``llama_sampler_xtc``).

With probability ``xtc_probability`` per step, when at least two tokens have probability
``>= xtc_threshold``, every one of them except the least probable is removed (ties: the highest
id stays, the last in "probability desc, id asc" order). Not argmax-invariant (it removes the
top token), so it runs at step 5 on the logits before temperature, where llama.cpp's chain puts
it. Greedy rows are left alone.

The coin: a seeded request flips it with its own ``torch.Generator``, made from the request's
seed when it joins the batch (a stream distinct from the sampler's draw, so the two are not
correlated), and moved with its row: its outputs never depend on the rest of the batch. The
processor interface (vLLM's) hands processors the request's params, not the sampler's generator.
Unseeded rows flip with the processor's generator, seeded from the config's ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from worker.logits_processor.library.base import NEG_INF, LibraryProcessor
from worker.logits_processor.schema import ExtraArgs
from worker.sampling_params import SamplingParams

_STREAM_TAG = 0x58544321  # "XTC!": keeps the coin's stream apart from the draw's


class XTCArgs(ExtraArgs):
    xtc_probability: float = Field(ge=0.0, le=1.0, description="Chance per step that XTC acts; 0 = off.")
    xtc_threshold: float = Field(0.1, gt=0.0, le=1.0, description="Tokens with p >= threshold are top choices.")


@dataclass(frozen=True)
class _Row:
    threshold: float
    probability: float
    generator: torch.Generator | None  # the request's own coin stream when it is seeded


def coin_generator(seed: int) -> torch.Generator:
    """The request's coin stream: a splitmix64 mix of its seed and the stream tag."""
    z = (seed + _STREAM_TAG * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return torch.Generator().manual_seed(z ^ (z >> 31))


class XTCLogitsProcessor(LibraryProcessor[_Row, XTCArgs]):
    """``extra_args={"xtc_probability": 0.5, "xtc_threshold": 0.1}`` on a sampled request."""

    extra_args_model = XTCArgs

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(config, device, is_pin_memory)
        self._generator = torch.Generator().manual_seed(int(getattr(config, "seed", 0) or 0))

    def _row_state(
        self, args: XTCArgs, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _Row | None:
        if args.xtc_probability <= 0.0 or args.xtc_threshold > 0.5:  # > 0.5: never two top choices
            return None
        gen = coin_generator(params.seed) if params.seed is not None else None
        return _Row(float(args.xtc_threshold), float(args.xtc_probability), gen)

    def _coins(self) -> list[float]:
        """One uniform in [0, 1) per active row, in row order, every step."""
        shared = torch.rand(len(self._row_list), dtype=torch.float64, generator=self._generator).tolist()
        out = []
        for i, (_, s) in enumerate(self.states.items()):
            out.append(torch.rand(1, dtype=torch.float64, generator=s.generator).item() if s.generator else shared[i])
        return out

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.states:
            return logits
        self._ensure_built(logits.shape[1])
        coins = self._coins()
        firing = [(row, s.threshold) for u, (row, s) in zip(coins, self.states.items()) if u <= s.probability]
        if not firing:
            return logits
        rows = self._stage([r for r, _ in firing], torch.int64)
        sub = logits if len(firing) == logits.shape[0] else logits.index_select(0, rows)
        # At most 1/threshold tokens reach the threshold: the top-k candidates hold them all, so
        # two passes over the rows (log_softmax, topk) and the rest on [rows, k].
        k = min(sub.shape[1], int(1.0 / min(t for _, t in firing)) + 1)
        logp = torch.log_softmax(sub, dim=-1)
        lp, ids = torch.topk(logp, k, dim=-1)
        probs = torch.exp(lp)
        top = probs >= self._stage([t for _, t in firing], torch.float32)[:, None].to(probs.dtype)
        lowest = torch.where(top, probs, torch.inf).amin(-1, keepdim=True)
        kept = torch.where(top & (probs == lowest), ids, -1).amax(-1, keepdim=True)  # ties: highest id stays
        remove = top & (ids != kept) & (top.sum(-1, keepdim=True) >= 2)
        local, col = remove.nonzero(as_tuple=True)
        logits[rows[local], ids[local, col]] = NEG_INF
        return logits

    def is_argmax_invariant(self) -> bool:
        return False

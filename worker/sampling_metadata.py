"""What the sampler reads about the batch besides the logits: rebuilt only when the batch changes.

Built by ``PersistentBatch.sampling_metadata()`` from its per-row columns; every tensor is on the
sampler's device and has one entry per row of the batch, in row order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class HostColumns:
    """The same per-row settings as host values (the batch's CPU columns), so that the sampler's
    plan is built without reading the device tensors back (no sync per batch change)."""

    greedy: tuple[bool, ...]
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]  # the float32 column's values
    num_logprobs: tuple[int, ...]


@dataclass(frozen=True)
class SamplingMetadata:
    # [B] float32. Greedy rows (temperature < 1e-5) hold their raw value; the sampler
    # divides them by 1, never by ~0.
    temperature: torch.Tensor
    # [B] bool, True where the row is greedy.
    greedy_mask: torch.Tensor
    all_greedy: bool
    all_random: bool
    # [B] int64, 0 = off, else k (greedy rows are off). None when no row uses top-k.
    top_k: torch.Tensor | None
    # [B] float32, 1.0 = off (greedy rows are off). None when no row uses top-p.
    top_p: torch.Tensor | None
    # Row -> its own generator, for seeded requests; the rest draw from the sampler's.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Largest `logprobs` asked in the batch, None when no row asks for logprobs.
    max_num_logprobs: int | None = None
    # [B] int64, the row's `logprobs` (-1 = none). None when no row asks.
    num_logprobs: torch.Tensor | None = None
    # Per row: one of SamplingParams' LOGPROBS_MODES (only meaningful where num_logprobs >= 0).
    logprobs_modes: tuple[str, ...] = ()
    # True when no row uses repetition/frequency/presence penalties (step 6 is skipped).
    no_penalties: bool = True
    # The host values of greedy_mask / top_k / top_p / num_logprobs; None: the plan reads them back.
    host: HostColumns | None = None

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

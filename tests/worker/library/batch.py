"""Run one library processor over a batch the way the engine does (add every row, then apply)."""

from __future__ import annotations

from typing import Any

import torch

from worker.logits_processor.interface import BatchUpdate, LogitsProcessor
from worker.sampling_params import SamplingParams

CPU = torch.device("cpu")


def add_all(
    proc: LogitsProcessor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> None:
    added = [(i, p, prompts[i], outputs[i]) for i, p in enumerate(params)]
    proc.update_state(BatchUpdate(batch_size=len(params), removed=[], moved=[], added=added))


def apply_once(
    cls: type[LogitsProcessor],
    params: list[SamplingParams],
    logits: torch.Tensor,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    config: Any = None,
) -> torch.Tensor:
    proc = cls(config, CPU, False)
    n = len(params)
    add_all(proc, params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)])
    return proc.apply(logits.clone())


def random_logits(seed: int, rows: int, vocab: int, scale: float = 3.0) -> torch.Tensor:
    """Standard-normal logits times ``scale``, with some -inf (seeded)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * scale
    x[torch.rand(rows, vocab, generator=g) < 0.1] = float("-inf")
    return x

"""Reusable scratch buffers: large temporaries are allocated once, not every step.

On CPU a fresh [B, V] allocation costs page faults worth several memory passes, so the sampler
and the processors keep their big temporaries in ``Buffer`` slots, one per use, named as fields
of a dataclass (``TopPScratch``, the sampler's ``_Scratch``). A tensor a slot hands out is valid
until that slot's next ``take``; nothing returned to a caller may alias one.
"""

from __future__ import annotations

import math

import torch


class Buffer:
    """One growable scratch tensor; its storage is kept while what is asked for fits."""

    __slots__ = ("_storage",)

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape``, in this slot's storage when it fits."""
        numel = math.prod(shape)
        s = self._storage
        if s is None or s.dtype != dtype or s.device != device or s.numel() < numel:
            s = self._storage = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return s[:numel].view(shape)

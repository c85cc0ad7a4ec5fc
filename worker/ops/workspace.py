"""Reusable scratch buffers: large temporaries are allocated once, not every step.

On CPU a fresh [B, V] allocation costs page faults worth several memory passes, so the sampler
and the processors keep their big temporaries here. A buffer handed out is valid until the
next ``get`` of the same name; nothing returned to a caller may alias one.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Named, growable scratch buffers on one device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape``, reusing ``name``'s storage when it fits."""
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)

    def clear(self) -> None:
        self._bufs.clear()

"""Reusable scratch buffers: large temporaries are allocated once, not every step.

On CPU a fresh [B, V] allocation costs page faults worth several memory passes, so the sampler
and the processors keep their big temporaries here. A buffer handed out is valid until the
next ``get`` of the same name; nothing returned to a caller may alias one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


class Workspace:
    """Named, growable scratch buffers on one device."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}
        self._consts: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape``, reusing ``name``'s storage when it fits."""
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)

    def cached(self, name: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A constant built once by ``make`` (on this device) and kept under ``name``."""
        if name not in self._consts:
            self._consts[name] = make().to(self.device)
        return self._consts[name]

    def clear(self) -> None:
        self._consts.clear()
        self._bufs.clear()

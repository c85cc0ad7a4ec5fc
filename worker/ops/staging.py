"""Host-built index/value tensors to the processors' device (pinned staging when allowed).

``stage`` pins a fresh tensor per call; ``DoubleBuffer`` reuses two pinned buffers for tensors
built every step (the batch's sampling columns, the grammar bitmask).
"""

from __future__ import annotations

import array
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """A CPU int64 tensor of Python ints, through ``array`` (about 4x faster than ``torch.tensor``
    on a list: a step's index lists run to tens of thousands of entries at large batches)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def stage(
    values: Sequence[int] | Sequence[float] | torch.Tensor, dtype: torch.dtype, device: torch.device, pin: bool
) -> torch.Tensor:
    """A device tensor of ``values``; through pinned memory and a non-blocking copy when ``pin``."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    if pin:
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host-built tensor on ``device``: pinned and non-blocking on CUDA. ``torch.tensor(
    values, device=cuda)`` copies from pageable memory and then syncs the stream: the host waits
    for all the device's queued work."""
    return stage(list(values), dtype, device, pin=device.type == "cuda")


class CopyEvent(Protocol):
    """What a staged copy records and its buffer's reuse waits on (``torch.cuda.Event``)."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class _NoEvent:
    """CPU: the copy is done when ``to_device`` returns; nothing to wait for."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class DoubleBuffer:
    """Two host buffers of one dtype, used in turn, for host-built tensors copied to the device.

    A non-blocking copy from pinned memory is still reading its source after the call returns,
    so the buffer must not be rewritten until the copy is done. Each half records an event after
    its copy, and handing that half out again waits on that event first: the host fills one
    half while the other's copy may still be in flight. Safe without the syncs elsewhere in the
    step that happen to cover it today. On CPU the events do nothing.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        device: torch.device,
        pin_memory: bool,
        event_factory: Callable[[], CopyEvent] | None = None,
    ) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type != "cpu"
        if event_factory is None:
            event_factory = torch.cuda.Event if self.device.type == "cuda" else _NoEvent
        self._new_event = event_factory
        self._buffers = [torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)]
        self._events: list[CopyEvent | None] = [None, None]
        self._next = 0
        self._filling: int | None = None  # the half handed out by ``host``, not yet copied

    def host(self, *shape: int) -> torch.Tensor:
        """The next half as a host tensor of ``shape`` to fill, once its last copy is done."""
        half, self._next = self._next, self._next ^ 1
        event = self._events[half]
        if event is not None:
            event.synchronize()
        numel = math.prod(shape)
        if self._buffers[half].numel() < numel:
            grown = max(numel, 2 * self._buffers[half].numel())
            self._buffers[half] = torch.empty(grown, dtype=self.dtype, pin_memory=self.pin_memory)
        self._filling = half
        return self._buffers[half][:numel].view(shape)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Copy what ``host`` handed out to the device (non-blocking when pinned); the copy's
        event is what that half's next ``host`` waits on. The result never aliases the buffer."""
        half = self._filling
        if half is None:
            raise RuntimeError("DoubleBuffer.to_device: no half handed out by host() to copy")
        self._filling = None
        out = host.to(self.device, non_blocking=self.pin_memory, copy=True)
        event = self._events[half]
        if event is None:
            event = self._events[half] = self._new_event()
        event.record()
        return out

    def stage(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a host tensor) on the device, through the next half."""
        host = self.host(*values.shape)
        host.copy_(values)
        return self.to_device(host)

"""The one place a step's device results reach the host (docs/sampling.md "Host reads").

On an accelerator every device-to-host read waits for the stream: a sync. ``to_host`` brings
several tensors over in ONE transfer (their bytes concatenated on the device, one copy, split
again on the host), and counts it, so a test can assert how many reads a step made
(``record_host_reads``). Tensors are ordered by element size before packing, so every part
starts at an offset its dtype can be viewed at. ``start_to_host`` issues the same transfer into
pinned memory and returns before it is done; its ``wait`` then waits for that copy alone, not
for work queued after it (the next step, under async scheduling).

Under ``torch.cuda.set_sync_debug_mode("error")`` this wait is the one sync allowed: the mode is
lifted for the wait alone, so any other sync in the step still raises.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True)
class HostRead:
    """One transfer: who asked, how many tensors and bytes it brought."""

    label: str
    tensors: int
    nbytes: int


_lock = threading.Lock()
_recorders: list[list[HostRead]] = []
_total = [0]  # one cell: reads since the process started


def total_host_reads() -> int:
    """Reads made through ``to_host`` since the process started (for benchmarks' per-step counts)."""
    return _total[0]


@contextmanager
def record_host_reads() -> Iterator[list[HostRead]]:
    """Every ``to_host`` call (any thread) made inside the block, appended to the yielded list."""
    log: list[HostRead] = []
    with _lock:
        _recorders.append(log)
    try:
        yield log
    finally:
        with _lock:
            _recorders.remove(log)


def _note(read: HostRead) -> None:
    with _lock:
        _total[0] += 1
        for log in _recorders:
            log.append(read)


def to_host(*tensors: torch.Tensor, label: str = "") -> tuple[torch.Tensor, ...]:
    """Host (CPU) copies of ``tensors`` (same dtypes and shapes), brought over in one transfer.

    The copies never alias the inputs, on CPU too (the sampler may write its buffers again).
    """
    return start_to_host(*tensors, label=label).wait()


class HostCopy:
    """One transfer to the host, issued (``start_to_host``) and not yet waited for.

    On CUDA the bytes go to pinned memory by a non-blocking copy and an event marks its end, so
    the host may launch more work before it waits: ``wait`` then waits for this copy alone, not
    for what was queued after it (async scheduling launches the next step in between).
    """

    def __init__(
        self,
        tensors: tuple[torch.Tensor, ...],
        host: torch.Tensor | None = None,
        done: torch.cuda.Event | None = None,
        spans: tuple[tuple[int, int, int], ...] = (),
    ) -> None:
        """``host`` None: ``tensors`` are the host copies already. Else ``spans`` places tensor
        ``i`` at bytes [offset, offset + n) of ``host`` as (i, offset, n)."""
        self._tensors, self._host, self._done, self._spans = tensors, host, done, spans

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self._host is None:  # CPU: the copies were made when it was issued
            return self._tensors
        if self._done is not None:
            _synchronize(self._done)
        out = list(self._tensors)
        for i, offset, n in self._spans:
            out[i] = self._host[offset : offset + n].view(out[i].dtype).view(out[i].shape)
        return tuple(out)


def start_to_host(*tensors: torch.Tensor, label: str = "") -> HostCopy:
    """Issue ``to_host``'s one transfer without waiting for it (counted as one read)."""
    parts = [t.detach().contiguous().reshape(-1) for t in tensors]
    order = sorted(range(len(parts)), key=lambda i: -parts[i].element_size())
    sizes = [parts[i].numel() * parts[i].element_size() for i in order]
    _note(HostRead(label, len(tensors), sum(sizes)))
    if not parts:
        return HostCopy(())
    if all(t.device.type == "cpu" for t in tensors):  # no transfer to batch: a copy of each is less work
        return HostCopy(tuple(t.detach().clone() for t in tensors))
    offsets = accumulate(sizes, initial=0)
    spans = tuple((i, offset, n) for i, offset, n in zip(order, offsets, sizes))
    flat = torch.cat([parts[i].view(torch.uint8) for i in order])  # cat: a fresh tensor
    if flat.device.type != "cuda":
        return HostCopy(tensors, flat.cpu(), spans=spans)
    host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostCopy(tensors, host, done, spans)


def _synchronize(done: torch.cuda.Event) -> None:
    """The wait for a read's copy: the one sync a step makes (allowed under sync debug mode)."""
    mode = torch.cuda.get_sync_debug_mode()
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        done.synchronize()
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def host_lists(*tensors: torch.Tensor, label: str = "") -> tuple[list, ...]:
    """``to_host`` and then Python lists (``tolist``) of each."""
    return tuple(t.tolist() for t in to_host(*tensors, label=label))


def cpu_all(t: torch.Tensor) -> bool:
    """Whether every element of a CPU tensor is true: free on the host (no device to wait for), so
    not a sync and not counted; an accelerator tensor is refused (that would be a read: ``to_host``)."""
    if t.device.type != "cpu":
        raise ValueError(f"cpu_all: a {t.device.type} tensor; on an accelerator this would be a sync")
    return bool(t.all())


def as_lists(*tensors: torch.Tensor) -> tuple[list, ...]:
    """Lists of tensors already on the host (what ``to_host`` returned); no read is made, and a
    tensor still on an accelerator is refused rather than synced on silently."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"as_lists: a {t.device.type} tensor; bring it over with to_host first")
    return tuple(t.tolist() for t in tensors)

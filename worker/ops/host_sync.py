"""The one place a step's device results reach the host (docs/sampling.md "Host reads").

On an accelerator every device-to-host read waits for the stream: a sync. ``to_host`` brings
several tensors over in ONE transfer (their bytes concatenated on the device, one copy, split
again on the host), and counts it, so a test can assert how many reads a step made
(``record_host_reads``). Tensors are ordered by element size before packing, so every part
starts at an offset its dtype can be viewed at.

Under ``torch.cuda.set_sync_debug_mode("error")`` this copy is the one sync allowed: the mode is
lifted for the copy alone, so any other sync in the step still raises.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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
    parts = [t.detach().contiguous().reshape(-1) for t in tensors]
    order = sorted(range(len(parts)), key=lambda i: -parts[i].element_size())
    sizes = [parts[i].numel() * parts[i].element_size() for i in order]
    _note(HostRead(label, len(tensors), sum(sizes)))
    if not parts:
        return ()
    if all(t.device.type == "cpu" for t in tensors):  # no transfer to batch: a copy of each is less work
        return tuple(t.detach().clone() for t in tensors)
    host = _copy_to_host(torch.cat([parts[i].view(torch.uint8) for i in order]))  # cat: a fresh tensor
    out = list(tensors)
    offset = 0
    for i, n in zip(order, sizes):
        out[i] = host[offset : offset + n].view(tensors[i].dtype).view(tensors[i].shape)
        offset += n
    return tuple(out)


def _copy_to_host(flat: torch.Tensor) -> torch.Tensor:
    if flat.device.type == "cpu":
        return flat
    if flat.device.type != "cuda":
        return flat.cpu()
    mode = torch.cuda.get_sync_debug_mode()
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        return flat.cpu()
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

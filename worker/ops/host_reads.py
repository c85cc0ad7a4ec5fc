"""Small device results queued during a step so that they reach the host in one transfer."""

from __future__ import annotations

import torch


class HostReads:
    """``queue`` a small tensor now, ``read`` it later: the first ``read`` brings every tensor
    queued so far to the host at once (one sync on an accelerator, not one per flag)."""

    def __init__(self) -> None:
        self._queued: list[torch.Tensor] = []
        self._read: list[list[int]] = []

    def queue(self, t: torch.Tensor) -> int:
        """A handle for ``read``; ``t`` is read flattened, as int64."""
        self._queued.append(t.reshape(-1).to(torch.int64))
        return len(self._queued) - 1

    def read(self, handle: int) -> list[int]:
        if handle >= len(self._read):
            new = self._queued[len(self._read) :]
            flat = torch.cat(new).tolist()
            for t in new:
                self._read.append(flat[: t.numel()])
                flat = flat[t.numel() :]
        return self._read[handle]

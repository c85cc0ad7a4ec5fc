"""Host-built index/value tensors to the processors' device (pinned staging when allowed)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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

"""Step 8 helpers: logprob sources per mode, the sampled token's logprob and its rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.ops.workspace import Workspace


def to_logprobs_(src: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """In place: rows whose mode ends in ``logprobs`` become ``log_softmax``; ``*_logits`` rows stay."""
    rows = [i for i, m in enumerate(modes) if m.endswith("logprobs")]
    if len(rows) == src.shape[0]:
        torch.log_softmax(src, -1, out=src)
    elif rows:
        idx = torch.tensor(rows, device=src.device)
        src.index_copy_(0, idx, torch.log_softmax(src.index_select(0, idx), -1))
    return src


def sampled_logprob_and_rank(
    src: torch.Tensor, sampled: torch.Tensor, ws: Workspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] value of ``src`` at ``sampled``, [n] int64 rank = count(src >= that value), 1-based).

    Counted through a float32 0/1 tensor: summing floats is vectorised where a bool sum is not,
    and exact for V < 2^24.
    """
    lp = src.gather(1, sampled.clamp_min(0)[:, None])
    ge = torch.ge(src, lp, out=ws.get("rank_ge", tuple(src.shape), torch.float32))
    return lp.squeeze(1), ge.sum(-1).to(torch.int64)

"""Step 8 helpers: logprob sources per mode, the sampled token's logprob and its rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.ops.plan import RowGroup
from worker.ops.scratch import Buffer
from worker.ops.staging import to_device


def _wants_logprobs(mode: str) -> bool:
    return mode.endswith("logprobs")


def to_logprobs_(src: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """In place: rows whose mode ends in ``logprobs`` become ``log_softmax``; ``*_logits`` rows stay."""
    rows = [i for i, m in enumerate(modes) if _wants_logprobs(m)]
    if len(rows) == src.shape[0]:
        torch.log_softmax(src, -1, out=src)
    elif rows:
        idx = to_device(rows, torch.int64, src.device)
        src.index_copy_(0, idx, torch.log_softmax(src.index_select(0, idx), -1))
    return src


def logprob_rows(x: torch.Tensor, rows: RowGroup, modes: Sequence[str], out: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``x`` into ``out`` [len(rows), V] as their ``modes`` want them (``to_logprobs_``).

    Read in place run by run; when every mode is a logprobs one, ``log_softmax`` writes ``out``
    directly (no copy first).
    """
    direct = all(_wants_logprobs(m) for m in modes)
    for r in rows.runs:
        part = x[r.batch : r.batch + r.length]
        dst = out[r.local : r.local + r.length]
        if direct:
            torch.log_softmax(part, -1, out=dst)
        else:
            dst.copy_(part)
    return out if direct else to_logprobs_(out, modes)


def sampled_logprob_and_rank(
    src: torch.Tensor, sampled: torch.Tensor, scratch: Buffer
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] value of ``src`` at ``sampled``, [n] int64 rank = count(src >= that value), 1-based).

    Counted through a float32 0/1 tensor (in ``scratch``): summing floats is vectorised where a
    bool sum is not, and exact for V < 2^24.
    """
    lp = src.gather(1, sampled.clamp_min(0)[:, None])
    ge = torch.ge(src, lp, out=scratch.take(tuple(src.shape), torch.float32, src.device))
    return lp.squeeze(1), ge.sum(-1).to(torch.int64)

"""Repetition, frequency and presence penalties on exactly the (row, token) pairs a row has seen.

No [B, V] temporaries: seen tokens are flat keys ``local_row * V + token``; ``unique`` gives
the distinct keys (and output counts), and each penalty is a gather-modify-scatter over them.
The float operations are the reference ones, elementwise, so results are bit-identical to
applying the formulas row by row.
"""

from __future__ import annotations

import torch


def apply_repetition_(logits: torch.Tensor, rows: torch.Tensor, penalty: torch.Tensor, seen_keys: torch.Tensor) -> None:
    """``x / r`` where ``x > 0`` else ``x * r`` at every key of ``seen_keys`` (unique, local_row * V + tok).

    ``rows`` [n] maps a local row to its batch row; ``penalty`` [n] float32.
    """
    if seen_keys.numel() == 0:
        return
    v = logits.shape[1]
    local, tok = seen_keys // v, seen_keys % v
    r = penalty[local]
    at = (rows[local], tok)
    x = logits[at]
    logits[at] = torch.where(x > 0, x / r, x * r)


def apply_frequency_presence_(
    logits: torch.Tensor,
    rows: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    output_keys: torch.Tensor,
) -> None:
    """``x -= f * count`` then ``x -= p * (count > 0)`` over output tokens (keys may repeat)."""
    if output_keys.numel() == 0:
        return
    v = logits.shape[1]
    keys, counts = torch.unique(output_keys, return_counts=True)
    local, tok = keys // v, keys % v
    at = (rows[local], tok)
    x = logits[at]
    x = x - frequency[local] * counts.to(x.dtype)
    x = x - presence[local] * (counts > 0).to(x.dtype)
    logits[at] = x

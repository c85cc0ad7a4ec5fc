"""Repetition, frequency and presence penalties on exactly the (row, token) pairs a row has seen.

No [B, V] temporaries: seen tokens are flat keys ``local_row * V + token``, made distinct on the
host (the lists live there, and a device ``unique`` would cost a sync); each penalty is then a
gather-modify-scatter over those keys. The float operations are the reference ones,
elementwise, so results are bit-identical to applying the formulas row by row.
"""

from __future__ import annotations

import torch

from worker.ops.flat import put2d_, take2d


def seen_keys(prompt_keys: torch.Tensor, output_keys: torch.Tensor) -> torch.Tensor:
    """Distinct keys of prompt ∪ output (host tensors; ``prompt_keys`` sorted and distinct)."""
    out = torch.unique(output_keys)
    if prompt_keys.numel() == 0 or out.numel() == 0:
        return torch.cat([prompt_keys, out])
    pos = torch.searchsorted(prompt_keys, out).clamp_max(prompt_keys.numel() - 1)
    return torch.cat([prompt_keys, out[prompt_keys[pos] != out]])


def apply_repetition_(logits: torch.Tensor, rows: torch.Tensor, penalty: torch.Tensor, keys: torch.Tensor) -> None:
    """``x / r`` where ``x > 0`` else ``x * r`` at every distinct key ``local_row * V + tok``.

    ``rows`` [n] maps a local row to its batch row; ``penalty`` [n] float32.
    """
    if keys.numel() == 0:
        return
    v = logits.shape[1]
    local, tok = keys // v, keys % v
    r = penalty[local]
    x = take2d(logits, rows[local], tok)
    put2d_(logits, rows[local], tok, torch.where(x > 0, x / r, x * r))


def apply_frequency_presence_(
    logits: torch.Tensor,
    rows: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    keys: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """``x -= f * count`` then ``x -= p * (count > 0)`` at distinct output ``keys`` with their ``counts``."""
    if keys.numel() == 0:
        return
    v = logits.shape[1]
    local, tok = keys // v, keys % v
    x = take2d(logits, rows[local], tok)
    x = x - frequency[local] * counts.to(x.dtype)
    x = x - presence[local] * (counts > 0).to(x.dtype)
    put2d_(logits, rows[local], tok, x)

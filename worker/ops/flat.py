"""Scattered (row, column) reads and writes of a 2-D tensor through one flat index.

A two-index advanced index (``x[rows, cols]``) costs several times a one-index gather of the
same elements on CPU, so these address the tensor's storage as one dimension instead.
"""

from __future__ import annotations

import torch


def _flat(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-D view of the storage ``x`` [n, m] spans, and the positions of (rows, cols) in it."""
    (n, m), (s0, s1) = x.shape, x.stride()
    span = (n - 1) * s0 + (m - 1) * s1 + 1 if n and m else 0
    return x.as_strided((span,), (1,)), rows * s0 + cols * s1


def take2d(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``x[rows, cols]``."""
    view, pos = _flat(x, rows, cols)
    return view.index_select(0, pos)


def put2d_(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor | float) -> None:
    """``x[rows, cols] = values``, in place; (rows, cols) pairs must be distinct."""
    view, pos = _flat(x, rows, cols)
    if isinstance(values, torch.Tensor):
        view.index_copy_(0, pos, values.to(x.dtype))
    else:
        view.index_fill_(0, pos, values)

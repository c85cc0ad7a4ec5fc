"""``x < threshold -> -inf`` on some rows of a batch, in place (Min-P's cut, in logit space)."""

from __future__ import annotations

import torch

from worker.ops.plan import RowGroup
from worker.ops.scratch import Buffer

_NEG_INF = float("-inf")


def drop_below_(
    x: torch.Tensor, rows: RowGroup, threshold: torch.Tensor, scratch: Buffer, *, on_host: bool | None = None
) -> None:
    """Rows ``rows`` of ``x``: every value below the row's ``threshold`` ([len(rows), 1]) becomes -inf.

    On CPU (``on_host`` None) the thresholds are read to the host, which costs nothing there, and
    each row takes one in-place ``threshold_`` pass; elsewhere no host read is made and three
    passes do it. Both give the same values; a NaN threshold (a row holding NaN, which fails
    anyway) leaves the host form's row as it is.
    """
    if x.device.type == "cpu" if on_host is None else on_host:
        # threshold_ keeps x > t: t is the float just under the threshold, so x == threshold stays.
        under = torch.nextafter(threshold, torch.tensor(_NEG_INF, dtype=threshold.dtype, device=threshold.device))
        for r, t in zip(rows.rows, under.flatten().tolist()):
            if t == t:
                torch.threshold_(x[r], t, _NEG_INF)
        return
    # Branch-free: min(x, copysign(inf, x - threshold)), where copysign gives +inf for kept
    # tokens (x == threshold too) and -inf for dropped ones.
    diff = scratch.take((len(rows), x.shape[1]), x.dtype, x.device)
    inf = x.new_full((), float("inf"))  # a fill kernel: torch.tensor(..., device=) would sync
    for run in rows.runs:
        sub, d = x[run.batch : run.batch + run.length], diff[run.local : run.local + run.length]
        torch.sub(sub, threshold[run.local : run.local + run.length], out=d)
        torch.copysign(inf, d, out=d)
        torch.minimum(sub, d, out=sub)

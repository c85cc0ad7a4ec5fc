"""Min-P's cut, ``x < threshold -> -inf`` on some rows: the host form (one ``threshold_`` pass per
row) and the device form (no host read) both give the plain rule, and leave other rows alone."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.sampler_reference import logit_rows
from worker.ops.cutoff import drop_below_
from worker.ops.plan import row_group
from worker.ops.scratch import Buffer

NEG_INF = float("-inf")


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from([5, 300, 3000]), st.sampled_from([0.0, 0.5, 2.0]))
def test_host_and_device_forms_drop_exactly_what_is_below(data: st.DataObject, v: int, below_max: float) -> None:
    x = data.draw(logit_rows(6, v))
    x[5] = NEG_INF  # a row with nothing finite: its threshold is -inf
    rows = row_group([4, 0, 1, 5], x.device)  # three runs; rows 2 and 3 are not in the group
    threshold = x[list(rows.rows)].amax(-1, keepdim=True) - below_max  # 0.0: ties with the max stay
    want = x.clone()
    for i, r in enumerate(rows.rows):
        want[r] = torch.where(x[r] < threshold[i], NEG_INF, x[r])
    for on_host in (True, False):
        got = x.clone()
        drop_below_(got, rows, threshold, Buffer(), on_host=on_host)
        assert torch.equal(got, want), on_host

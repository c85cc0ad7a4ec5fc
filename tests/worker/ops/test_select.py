"""Exact selection: first-occurrence argmax and top-k with ties toward lower ids, vs a sort."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.sampler_reference import logit_rows, order
from worker.ops.blocks import block_columns, block_reduce, block_size, gather_blocks
from worker.ops.plan import Run, row_group, runs_of
from worker.ops.select import ambiguous, exact_topk, row_argmax, topk_candidates

# Small vocabularies, one below the block size, tails of 1 and 136 columns, and one large
# enough that top-k takes the two-level block path.
VOCABS = [1, 5, 64, 257, 300, 5000]


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from(VOCABS))
def test_row_argmax_is_first_maximum(data: st.DataObject, v: int) -> None:
    x = data.draw(logit_rows(4, v))
    vals, ids = row_argmax(x)
    for r in range(4):
        assert ids[r].item() == order(x[r])[0]
        assert vals[r].item() == x[r].max().item()
    rows = torch.tensor([3, 1])  # a subset, read in place given the block maxima of every row
    sub_vals, sub_ids = row_argmax(x, block_reduce(x, block_size(v), "amax"), rows=rows)
    assert torch.equal(sub_ids, ids[rows]) and torch.equal(sub_vals, vals[rows])


def test_row_argmax_all_neg_inf_and_nan_rows() -> None:
    x = torch.zeros(2, 300)
    x[0] = float("-inf")
    x[1, 7] = float("nan")
    vals, ids = row_argmax(x)
    assert vals[0].item() == float("-inf") and 0 <= ids[0].item() < 300
    assert torch.isnan(vals[1])


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from(VOCABS), st.sampled_from([1, 2, 3, 7, 20, 70]))
def test_exact_topk_matches_sorted_prefix(data: st.DataObject, v: int, k: int) -> None:
    x = data.draw(logit_rows(3, v))
    vals, ids = exact_topk(x, k)
    kk = min(k, v)
    assert vals.shape == (3, kk)
    for r in range(3):
        want = order(x[r])[:kk]
        assert ids[r].tolist() == want
        assert torch.equal(vals[r], x[r, want])


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from([1, 4, 50]))
def test_topk_candidates_block_path_values_exact(data: st.DataObject, k: int) -> None:
    x = data.draw(logit_rows(3, 5000))
    rows = row_group([2, 0], x.device)
    vals, ids = topk_candidates(x, k, rows=rows)
    for i, r in enumerate(rows.rows):
        want = torch.sort(x[r], descending=True).values[: k + 1]
        assert torch.equal(vals[i], want)
        assert torch.equal(x[r, ids[i]], vals[i])
        assert len(set(ids[i].tolist())) == k + 1 or torch.isinf(want[-1])


def test_ambiguous_flags_ties_across_the_kth_place() -> None:
    vals = torch.tensor([[5.0, 4.0, 4.0, 3.0], [5.0, 4.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    k = torch.tensor([2, 2, 4 - 1])
    assert ambiguous(vals, k).tolist() == [True, False, True]
    assert ambiguous(vals, torch.tensor([4, 4, 4])).tolist() == [False, False, False]


def test_blocks_partition_the_row_with_a_tail() -> None:
    v, bs = 300, 256
    x = torch.arange(2 * v, dtype=torch.float32).view(2, v)
    assert torch.equal(block_reduce(x, bs, "sum"), torch.stack([x[:, :256].sum(-1), x[:, 256:].sum(-1)], 1))
    vals, starts = gather_blocks(x, torch.tensor([1]), torch.tensor([[1]]), bs, -1.0)
    ids = block_columns(starts, torch.arange(bs)[None, :], bs)
    # The tail window starts at V - bs; the columns before 256 belong to block 0 and are masked.
    assert ids[0, 0].item() == v - bs
    assert torch.equal(vals[0] == -1.0, ids[0] < 256)
    assert torch.equal(vals[0][ids[0] >= 256], x[1, 256:])


def test_runs_cut_a_group_where_batch_rows_stop_being_consecutive() -> None:
    assert runs_of([3, 4, 5, 0, 1, 7]) == (Run(3, 0, 3), Run(0, 3, 2), Run(7, 5, 1))
    assert runs_of(range(4)) == (Run(0, 0, 4),)
    x = torch.randn(8, 600)
    group = row_group([3, 4, 5, 0, 1, 7], x.device)
    assert torch.equal(block_reduce(x, 256, "amax", group), block_reduce(x[list(group.rows)], 256, "amax"))

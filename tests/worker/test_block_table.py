"""The persistent BlockTable against a plain table rebuilt from the lists every step.

The rows are driven like the persistent batch drives its rows: requests join at the tail, grow
their block lists in place (as ``worker.kv`` does), leave (the last row moved into the hole, a
condense move), swap rows (the reorder pass), rewind (a recomputed suffix), and are preempted (the
list rebound to a fresh one). After every step the tensor equals the rebuilt reference, and the
work the sync did is only what changed.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.model.block_table import BlockTable

NULL = 99


def _reference(rows: list[list[int]], used: list[int], max_rows: int, width: int) -> torch.Tensor:
    ref = torch.full((max_rows, width), NULL, dtype=torch.int32)
    for i, (blocks, n) in enumerate(zip(rows, used)):
        ref[i, :n] = torch.tensor(blocks[:n], dtype=torch.int32)
    return ref


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_rows=st.integers(1, 9), width=st.integers(1, 12))
def test_sync_equals_a_rebuilt_table_under_churn(seed: int, max_rows: int, width: int) -> None:
    rng = random.Random(seed)
    table = BlockTable(max_rows, width, NULL)
    rows: list[list[int]] = []  # the batch's rows: each a request's live block list
    used: list[int] = []
    fresh = iter(range(10**6))
    for _ in range(25):
        appended = 0
        for _ in range(rng.randint(0, 3)):
            op = rng.choice(["join", "grow", "leave", "swap", "rewind", "preempt", "preempt_new", "decoded"])
            if op == "join" and len(rows) < max_rows:
                rows.append([next(fresh) for _ in range(rng.randint(0, width))])
                used.append(rng.randint(0, len(rows[-1])))
            elif op == "grow" and rows:
                i = rng.randrange(len(rows))
                rows[i].extend(next(fresh) for _ in range(rng.randint(0, width - len(rows[i]))))  # in place
                new = rng.randint(used[i], len(rows[i]))
                appended += new - used[i]
                used[i] = new
            elif op == "leave" and rows:
                i = rng.randrange(len(rows))
                rows[i], used[i] = rows[-1], used[-1]  # the last row condenses into the hole
                rows.pop(), used.pop()
            elif op == "swap" and len(rows) > 1:
                i, j = rng.sample(range(len(rows)), 2)
                rows[i], rows[j] = rows[j], rows[i]
                used[i], used[j] = used[j], used[i]
            elif op == "rewind" and rows:
                i = rng.randrange(len(rows))
                used[i] = rng.randint(0, used[i])
            elif op == "preempt" and rows:
                i = rng.randrange(len(rows))
                rows[i] = list(rows[i])  # freed and re-allocated: same blocks, a new list object
            elif op == "preempt_new" and rows:
                i = rng.randrange(len(rows))
                rows[i] = [next(fresh) for _ in range(len(rows[i]))]  # re-allocated: other blocks
            elif op == "decoded":
                rows = [list(r) for r in rows]  # a tensor-parallel rank: every list new each step
        before = table.num_appended
        table.sync(rows, used)
        assert torch.equal(table.table, _reference(rows, used, max_rows, width))
        assert table.num_rows == len(rows)
        assert table.num_appended - before <= appended  # only new entries are written as appends


def test_a_steady_decode_step_appends_only_the_new_blocks() -> None:
    table = BlockTable(4, 8, NULL)
    rows = [[1, 2], [3], [4, 5, 6]]
    table.sync(rows, [2, 1, 3])
    rewrites, swaps = table.num_rewrites, table.num_swaps
    rows[1].append(7)  # one row crosses into a new block
    table.sync(rows, [2, 2, 3])
    assert (table.num_rewrites, table.num_swaps, table.num_appended) == (rewrites, swaps, 1)
    rows[0], rows[2] = rows[2], rows[0]  # the batch swaps two rows: the tensor rows swap, nothing rewritten
    table.sync(rows, [3, 2, 2])
    assert (table.num_rewrites, table.num_swaps) == (rewrites, swaps + 1)
    assert torch.equal(table.table, _reference(rows, [3, 2, 2], 4, 8))
    table.sync(rows[:1], [3])  # two rows leave: cleared to the null block
    assert torch.equal(table.table, _reference(rows[:1], [3], 4, 8))


def test_a_rank_rebuilding_its_lists_each_step_appends_and_never_rewrites() -> None:
    """A tensor-parallel rank decodes the step's block lists afresh every step: same entries,
    new list objects. The rows are adopted (and appended to), not rewritten."""
    table = BlockTable(4, 8, NULL)
    rows = [[1, 2], [3], [4, 5, 6]]
    table.sync([list(r) for r in rows], [2, 1, 3])
    rewrites = table.num_rewrites
    rows[1].append(7)
    table.sync([list(r) for r in rows], [2, 2, 3])
    assert (table.num_rewrites, table.num_appended) == (rewrites, 1)
    rows[0] = [8, 9]  # a row whose entries really changed is rewritten
    table.sync([list(r) for r in rows], [2, 2, 3])
    assert table.num_rewrites == rewrites + 1
    assert torch.equal(table.table, _reference(rows, [2, 2, 3], 4, 8))


def test_primitives_equal_the_reference() -> None:
    table = BlockTable(3, 4, NULL)
    table.add_row(0, [5, 6, 7])
    table.add_row(2, [8])
    table.append_row(2, [9, 10])
    table.move_row(2, 1)
    want = [[5, 6, 7, NULL], [8, 9, 10, NULL], [NULL] * 4]
    assert table.table.tolist() == want
    table.swap_rows(0, 1)
    table.truncate_row(0, 1)
    table.clear_row(1)
    assert table.table.tolist() == [[8, NULL, NULL, NULL], [NULL] * 4, [NULL] * 4]
    with pytest.raises(ValueError, match="exceed the width"):
        table.append_row(0, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="rows exceed"):
        table.sync([[1]] * 4, [1] * 4)

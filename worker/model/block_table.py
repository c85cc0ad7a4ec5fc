"""BlockTable: the batch rows' block tables as one persistent ``[max_rows, max_blocks]`` int32 tensor.

Rebuilding a step's tables from Python lists costs O(rows x blocks) host work every step; here
the tensor (pinned on CUDA, so its rows copy to the device asynchronously) is kept in step with
the rows incrementally, like the persistent batch's own columns. Each row remembers the block
list it mirrors (the request's ``block_ids``) and how many of its entries it holds. Block lists
from ``worker.kv`` only grow while a request holds them and are rebound (a new list) when freed,
so a step appends only the new entries of a row still showing the same list object; a row
showing a list that sits in a later row (the persistent batch moved or swapped it there) swaps
the two rows; a row showing a new list that starts with the row's entries (a tensor-parallel
rank rebuilds the lists each step) adopts it and appends; any other row is rewritten; rows past
the step's last are cleared. Host work per step: one identity check per row plus the changed
entries (plus a C-speed compare of a row's entries where its list object is new).

Entries past a row's own blocks hold ``null_block``, a block the KV manager never hands out (or,
without the padded decode path, block 0, which a length mask hides), so a full-width gather of
any row reads only blocks that exist (the padded decode path's padding rows point there too).
Entries are range-checked as they enter, against ``[0, num_valid)``: a step's check costs only
its new entries. A failed check raises before the row is touched, so the table stays consistent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockTable:
    def __init__(
        self,
        max_rows: int,
        max_blocks: int,
        null_block: int,
        *,
        num_valid: int | None = None,
        pin_memory: bool = False,
    ) -> None:
        """``num_valid``: entries must lie in ``[0, num_valid)`` (None: unchecked)."""
        if max_rows < 1 or max_blocks < 1:
            raise ValueError(f"block table: needs >= 1 row and block, got {max_rows} x {max_blocks}")
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self.null_block = null_block
        self.num_valid = num_valid
        self._pin = pin_memory
        self.table = torch.full((max_rows, max_blocks), null_block, dtype=torch.int32, pin_memory=pin_memory)
        self.num_rows = 0  # rows past this one are all null_block
        self._source: list[Sequence[int] | None] = [None] * max_rows  # the list each row mirrors
        self._len = [0] * max_rows  # entries of it the row holds
        self._row_of: dict[int, int] = {}  # id(list) -> its row (the lists are held in _source)
        # What the syncs did, for tests and benches: rows rewritten, rows swapped, entries appended.
        self.num_rewrites = 0
        self.num_swaps = 0
        self.num_appended = 0

    # -- primitives (the reference test drives these directly) ---------------------------------

    def ensure_rows(self, rows: int) -> None:
        """Room for ``rows`` rows (at least doubling): a step of more sequences than the batch holds."""
        if rows <= self.max_rows:
            return
        grown = max(rows, 2 * self.max_rows)
        table = torch.full((grown, self.max_blocks), self.null_block, dtype=torch.int32, pin_memory=self._pin)
        table[: self.max_rows] = self.table
        self.table = table
        self._source += [None] * (grown - self.max_rows)
        self._len += [0] * (grown - self.max_rows)
        self.max_rows = grown

    def _check(self, blocks: Sequence[int]) -> None:
        """Raise unless every entry of ``blocks`` is a block id requests may hold."""
        if self.num_valid is not None and blocks and (min(blocks) < 0 or max(blocks) >= self.num_valid):
            raise ValueError(f"block ids must be in [0, {self.num_valid})")

    def _own(self, row: int, source: Sequence[int] | None) -> None:
        old = self._source[row]
        if old is not None and self._row_of.get(id(old)) == row:
            del self._row_of[id(old)]
        self._source[row] = source
        if source is not None:
            self._row_of[id(source)] = row

    def add_row(
        self, row: int, blocks: Sequence[int], n: int | None = None, *, source: Sequence[int] | None = None
    ) -> None:
        """Row ``row`` := the first ``n`` (default all) of ``blocks``, null past them."""
        n = len(blocks) if n is None else n
        if n > self.max_blocks:
            raise ValueError(f"block table: {n} blocks exceed the width {self.max_blocks}")
        self._check(blocks[:n])
        line = self.table[row]
        if n:
            line[:n] = torch.tensor(blocks[:n], dtype=torch.int32)
        if n < self._len[row]:
            line[n : self._len[row]] = self.null_block
        self._len[row] = n
        self._own(row, source)
        self.num_rewrites += 1

    def append_row(self, row: int, blocks: Sequence[int]) -> None:
        """Append ``blocks`` after the row's entries."""
        have, n = self._len[row], len(blocks)
        if have + n > self.max_blocks:
            raise ValueError(f"block table: {have + n} blocks exceed the width {self.max_blocks}")
        self._check(blocks)
        if n == 1:
            self.table[row, have] = blocks[0]
        elif n:
            self.table[row, have : have + n] = torch.tensor(blocks, dtype=torch.int32)
        self._len[row] = have + n
        self.num_appended += n

    def truncate_row(self, row: int, n: int) -> None:
        """Keep the row's first ``n`` entries (a sequence rewinding to an earlier position)."""
        if n < self._len[row]:
            self.table[row, n : self._len[row]] = self.null_block
            self._len[row] = n

    def clear_row(self, row: int) -> None:
        self.truncate_row(row, 0)
        self._own(row, None)

    def move_row(self, src: int, dst: int) -> None:
        """Row ``dst`` := row ``src`` (a condense move); ``src`` is cleared."""
        if src == dst:
            return
        self.table[dst] = self.table[src]
        self._len[dst] = self._len[src]
        self._own(dst, self._source[src])
        self._len[src] = 0  # the entries moved: clear without writing them twice
        self.table[src] = self.null_block
        self._source[src] = None

    def swap_rows(self, a: int, b: int) -> None:
        if a == b:
            return
        self.table[[a, b]] = self.table[[b, a]]
        self._len[a], self._len[b] = self._len[b], self._len[a]
        sa, sb = self._source[a], self._source[b]
        self._source[a], self._source[b] = sb, sa
        for row, src in ((a, sb), (b, sa)):
            if src is not None:
                self._row_of[id(src)] = row
        self.num_swaps += 1

    # -- one step --------------------------------------------------------------------------

    def sync(self, rows: Sequence[Sequence[int]], used: Sequence[int]) -> None:
        """Rows ``0..len(rows)-1`` := the first ``used[i]`` blocks of ``rows[i]``; later rows cleared."""
        if len(rows) > self.max_rows:
            raise ValueError(f"block table: {len(rows)} rows exceed its {self.max_rows}")
        for i, (blocks, n) in enumerate(zip(rows, used)):
            try:
                self._sync_row(i, blocks, n)
            except ValueError as exc:
                raise ValueError(f"row {i}: {exc}") from exc
        for i in range(len(rows), self.num_rows):
            self.clear_row(i)
        self.num_rows = len(rows)

    def _sync_row(self, i: int, blocks: Sequence[int], n: int) -> None:
        if self._source[i] is not blocks:
            j = self._row_of.get(id(blocks))
            old, have = self._source[i], self._len[i]
            if j is not None and j > i and self._source[j] is blocks:
                self.swap_rows(i, j)  # moved here by the batch: its entries come along
            elif old is not None and 0 < have <= n and old[:have] == blocks[:have]:
                # The same entries in a new list (a tensor-parallel rank decodes every step's
                # lists afresh; a re-allocation handed back the same blocks): adopt it. The row
                # holds old[:have] because lists only grow in place. A C-speed compare, no write.
                self._own(i, blocks)
            else:
                self.add_row(i, blocks, n, source=blocks)
                return
        have = self._len[i]
        if n > have:
            self.append_row(i, blocks[have:n])
        elif n < have:
            self.truncate_row(i, n)

"""BlockPool and the prefix cache against a plain model, as a hypothesis state machine.

The model is the obvious bookkeeping: a refcount per block, a list of free blocks in eviction
order, a dict address -> block, and a "contents" map standing for the KV written in each block
(the tokens of the prefix it holds). Invariants: refcounts never negative, a referenced block is
never handed out again (so never overwritten), eviction is LRU over freed blocks, and a lookup
hit always returns a block whose contents are exactly the looked-up prefix.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from worker.kv.block_pool import BlockPool
from worker.kv.prefix_cache import BlockHash, hash_block

NUM_BLOCKS = 6
TOKENS = st.lists(st.integers(0, 3), min_size=2, max_size=2)  # tiny alphabet: many equal blocks


def _prefix_of(address: BlockHash) -> tuple[int, ...]:
    chain: list[tuple[int, ...]] = []
    node: BlockHash | None = address
    while node is not None:
        chain.append(node.tokens)
        node = node.parent
    return tuple(t for tokens in reversed(chain) for t in tokens)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.ref = [0] * NUM_BLOCKS
        self.free_order = list(range(NUM_BLOCKS))
        self.cached: dict[tuple[int, ...], int] = {}  # prefix tokens -> block
        self.contents: dict[int, tuple[int, ...] | None] = dict.fromkeys(range(NUM_BLOCKS))
        self.addresses: list[BlockHash] = []  # every address ever built (some evicted)
        self.held: list[int] = []  # one entry per reference taken

    # -- rules -------------------------------------------------------------------------

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def allocate(self, n: int) -> None:
        if n > len(self.free_order):
            with pytest.raises(ValueError, match="free"):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        expected, self.free_order = self.free_order[:n], self.free_order[n:]
        assert got == expected  # least recently freed first
        for b in got:
            assert self.ref[b] == 0  # never hand out a referenced block
            self.ref[b] = 1
            self.cached = {p: blk for p, blk in self.cached.items() if blk != b}  # evicted
            self.contents[b] = None  # about to be overwritten
            self.held.append(b)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), tokens=TOKENS, with_parent=st.booleans())
    def write_and_cache(self, data, tokens: list[int], with_parent: bool) -> None:
        """Write a full block into a held block and offer it to the cache."""
        block = data.draw(st.sampled_from(sorted({b for b in self.held if self.contents[b] is None} or {-1})))
        if block == -1:
            return
        parent = data.draw(st.sampled_from(self.addresses)) if with_parent and self.addresses else None
        address = hash_block(parent, tokens)
        prefix = _prefix_of(address)
        self.contents[block] = prefix
        self.addresses.append(address)
        accepted = self.pool.cache(block, address)
        assert accepted == (prefix not in self.cached)
        if accepted:
            self.cached[prefix] = block

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_one(self, data) -> None:
        block = data.draw(st.sampled_from(self.held))
        self.held.remove(block)
        self.pool.free([block])
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free_order.append(block)

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def free_unreferenced_is_refused(self, block: int) -> None:
        if self.ref[block] == 0:
            with pytest.raises(ValueError, match="not referenced"):
                self.pool.free([block])

    @precondition(lambda self: self.addresses)
    @rule(data=st.data())
    def lookup_and_touch(self, data) -> None:
        address = data.draw(st.sampled_from(self.addresses))
        prefix = _prefix_of(address)
        hit = self.pool.lookup(address)
        assert hit == self.cached.get(prefix)
        if hit is None:
            return
        assert self.contents[hit] == prefix  # a hit is always exact
        self.pool.touch([hit])
        if self.ref[hit] == 0:
            self.free_order.remove(hit)
        self.ref[hit] += 1
        self.held.append(hit)

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        assert self.pool.refcount == self.ref
        assert all(r >= 0 for r in self.pool.refcount)
        assert self.pool.num_free == len(self.free_order) == sum(r == 0 for r in self.ref)
        assert self.pool.num_cached == len(self.cached)
        for prefix, block in self.cached.items():
            assert self.contents[block] == prefix


TestBlockPool = PoolMachine.TestCase
TestBlockPool.settings = __import__("hypothesis").settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_address_includes_token_ids_and_whole_prefix() -> None:
    a = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == a and hash(hash_block(None, [1, 2])) == hash(a)
    assert hash_block(None, [2, 1]) != a
    assert hash_block(a, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])
    assert hash_block(a, [3, 4]) != hash_block(hash_block(None, [1, 3]), [3, 4])
    assert hash_block(a, [3, 4]) != hash_block(None, [3, 4])


def test_equal_int_hashes_never_make_a_false_hit() -> None:
    """Even if two prefixes' int hashes collide, equality (and so a dict hit) compares tokens."""
    a, b = hash_block(None, [1, 2]), hash_block(None, [5, 6])
    b.value = a.value  # force a collision
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.cache(block, a)
    assert pool.lookup(b) is None and pool.lookup(hash_block(None, [1, 2])) == block


def test_a_long_prefix_compares_without_recursion() -> None:
    x = y = None
    for i in range(5000):
        x, y = hash_block(x, [i]), hash_block(y, [i])
    assert x == y

"""BlockPool: fixed-size KV blocks with reference counts, and the prefix cache's LRU.

Every block is either referenced (refcount > 0, owned by one or more requests) or in the free
queue. A free block may still hold a cached prefix (its hash stays in the cache map until the
block is handed out again): free blocks are handed out least recently freed first, so unused
cached prefixes are evicted LRU. A referenced block is never handed out, so never overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from worker.kv.prefix_cache import BlockHash


@dataclass(frozen=True)
class CachedBlocks:
    """A copy of what the pool caches, for readers outside the engine thread (the routing
    report, cluster.routing): ``BlockHash`` objects never change once built."""

    addresses: tuple[BlockHash, ...]
    num_free: int
    num_blocks: int


class BlockPool:
    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.refcount = [0] * num_blocks
        # Free blocks in eviction order (front = evicted first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # address -> block holding it
        self._hash_of: dict[int, BlockHash] = {}  # block -> its address, while cached
        self.num_evictions = 0

    # -- reading -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (unreferenced, cached or not)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a cached prefix (referenced or not)."""
        return len(self._hash_of)

    def lookup(self, address: BlockHash) -> int | None:
        return self._cached.get(address)

    def cached(self) -> CachedBlocks:
        """Every cached address and the free count, copied (call it where the pool is changed)."""
        return CachedBlocks(tuple(self._hash_of.values()), len(self._free), self.num_blocks)

    # -- changing ----------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with refcount 1, least recently freed first; ValueError if too few are free."""
        if n > len(self._free):
            raise ValueError(f"need {n} KV blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            address = self._hash_of.pop(block, None)
            if address is not None:
                del self._cached[address]
                self.num_evictions += 1
            self.refcount[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the queue."""
        for block in blocks:
            if self.refcount[block] == 0:
                if block not in self._hash_of:
                    raise ValueError(f"block {block} is free and holds no cached prefix")
                del self._free[block]
            self.refcount[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference on each block; a block reaching 0 joins the queue's tail, in order given.

        Callers pass a request's blocks last first, so a prefix's tail is evicted before its head.
        """
        for block in blocks:
            if self.refcount[block] <= 0:
                raise ValueError(f"block {block} is not referenced")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self._free[block] = None

    def cache(self, block: int, address: BlockHash) -> bool:
        """Register a referenced, fully written block under ``address``; False if not cached.

        A prefix already cached in another block keeps that block (the new one stays private).
        """
        if not self.enable_caching or address in self._cached or block in self._hash_of:
            return False
        if self.refcount[block] <= 0:
            raise ValueError(f"block {block} is not referenced")
        self._cached[address] = block
        self._hash_of[block] = address
        return True

"""KVCacheManager: a request's block table over the pool, prefix-cache lookups and registration.

The request object carries its own block table (``block_ids``), the addresses of its full blocks
(``block_hashes``, computed once, valid as long as its tokens) and how many of its blocks were
offered to the cache (``num_registered_blocks``). The scheduler calls ``computed_prefix`` and
``allocate`` at admission, ``allocate`` before every step, ``free`` at finish or preemption; the
engine calls ``register_full_blocks`` after the forward that wrote the KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from worker.kv.block_pool import BlockPool
from worker.kv.prefix_cache import BlockHash, hash_block


class Sequenced(Protocol):
    """What the manager needs from a request (worker.request.Request)."""

    block_ids: list[int]
    block_hashes: list[BlockHash]
    num_registered_blocks: int
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_known_tokens(self) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.enable_caching = enable_caching
        self.num_query_tokens = 0  # tokens of admitted requests looked up in the prefix cache
        self.num_hit_tokens = 0  # ... of which were found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------

    def _addresses(self, req: Sequenced, num_blocks: int) -> list[BlockHash]:
        """The addresses of the request's first ``num_blocks`` full blocks (extends the memo)."""
        known, bs = req.block_hashes, self.block_size
        for i in range(len(known), num_blocks):
            known.append(hash_block(known[-1] if known else None, req.token_slice(i * bs, (i + 1) * bs)))
        return known[:num_blocks]

    def computed_prefix(self, req: Sequenced) -> list[int]:
        """Cached blocks holding the longest prefix of a request with no blocks; never its last token.

        At least the last token is always computed (its logits are needed), so a fully cached
        prompt still recomputes its last block into a fresh one: shared blocks are never written.
        """
        if not self.enable_caching or req.block_ids:
            return []
        hits: list[int] = []
        for address in self._addresses(req, (req.num_known_tokens - 1) // self.block_size):
            block = self.pool.lookup(address)
            if block is None:
                break
            hits.append(block)
        return hits

    def register_full_blocks(self, req: Sequenced) -> None:
        """Offer every newly completed block of the request to the prefix cache (a block whose
        last token is still on the device, async scheduling, waits until it is known)."""
        known = min(req.num_computed_tokens, req.num_known_tokens)
        full = min(known // self.block_size, len(req.block_ids))
        if full <= req.num_registered_blocks:
            return
        if self.enable_caching:
            addresses = self._addresses(req, full)
            for i in range(req.num_registered_blocks, full):
                self.pool.cache(req.block_ids[i], addresses[i])
        req.num_registered_blocks = full

    # -- allocation ------------------------------------------------------------------------

    def can_allocate(self, req: Sequenced, num_new_tokens: int, hits: Sequence[int] = ()) -> bool:
        need = self.blocks_for(req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens)
        new = need - len(req.block_ids) - len(hits)
        # A hit on a free cached block takes it out of the free queue.
        revived = sum(1 for b in hits if self.pool.refcount[b] == 0)
        return new + revived <= self.pool.num_free

    def allocate(self, req: Sequenced, num_new_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Extend the block table to hold ``num_new_tokens`` more tokens (after ``hits``); False if short.

        On success with hits, ``num_computed_tokens`` advances past the cached prefix.
        """
        if not self.can_allocate(req, num_new_tokens, hits):
            return False
        if hits:
            self.pool.touch(hits)
            req.block_ids.extend(hits)
            req.num_computed_tokens += len(hits) * self.block_size
            req.num_registered_blocks = len(req.block_ids)
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def free(self, req: Sequenced) -> None:
        """Release the request's blocks, tail first (evicted before the shared head of a prefix)."""
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_registered_blocks = 0

    def stats(self) -> dict[str, float]:
        pool = self.pool
        return {
            "block_size": self.block_size,
            "blocks_total": pool.num_blocks,
            "blocks_used": pool.num_used,
            "blocks_free": pool.num_free,
            "blocks_cached": pool.num_cached,
            "prefix_query_tokens": self.num_query_tokens,
            "prefix_hit_tokens": self.num_hit_tokens,
            "prefix_hit_rate": self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0,
            "num_evictions": pool.num_evictions,
        }

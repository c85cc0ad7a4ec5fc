"""Paged KV bookkeeping: the block pool, block hashes for prefix caching, per-request block tables.

Pure Python, no tensors: the runner owns the KV storage and only reads the block tables.
"""

from worker.kv.block_pool import BlockPool, CachedBlocks
from worker.kv.manager import KVCacheManager
from worker.kv.prefix_cache import BlockHash, hash_block

__all__ = ["BlockHash", "BlockPool", "CachedBlocks", "KVCacheManager", "hash_block"]

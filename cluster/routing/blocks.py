"""Block digests: the process-independent name of a full KV block that replicas publish and the
router computes from a request's token ids.

The worker's own address (`worker.kv.BlockHash`) is exact but its int uses Python's ``hash``,
which differs between processes (``hash(None)`` on 3.11, string salting), so it cannot cross
one. A digest is blake2b-64 chained the same way: over the parent block's digest and the
block's token ids, the first block's parent being `ROOT`. Two prefixes sharing a digest is
possible (64 bits) and costs a cache miss, never a wrong answer: the worker looks blocks up by
their exact address, whatever the router guessed.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence

from worker.kv import BlockHash

ROOT = 0  # the parent digest of a prompt's first block
_PERSON = b"logitpool-kv-v1"  # blake2b personalisation: a new digest rule gets a new one


def _tokens_bytes(tokens: Iterable[int]) -> bytes:
    """Token ids as little-endian int64 (the same bytes on every host)."""
    arr = array("q", tokens)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def _chain(parent: int, token_bytes: bytes) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8, person=_PERSON)
    h.update(token_bytes)
    return int.from_bytes(h.digest(), "little")


def prompt_digests(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The digests of the prompt's full blocks, first block first."""
    data = _tokens_bytes(token_ids)
    step = 8 * block_size
    out: list[int] = []
    parent = ROOT
    for start in range(0, (len(token_ids) // block_size) * step, step):
        parent = _chain(parent, data[start : start + step])
        out.append(parent)
    return out


def lookup_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks a prompt of ``num_tokens`` can find cached: never the one
    holding its last token, which is always computed (worker.kv.KVCacheManager.computed_prefix)."""
    return max(0, (num_tokens - 1) // block_size)


class DigestMemo:
    """Digest and depth of cached `BlockHash` chains, remembered between reports: a report after a
    few more steps hashes only the new blocks. Keeps only the addresses of the last call."""

    def __init__(self) -> None:
        self._known: dict[BlockHash, tuple[int, int]] = {}  # address -> (depth, digest)

    def of(self, addresses: Iterable[BlockHash]) -> dict[BlockHash, tuple[int, int]]:
        """(depth, digest) of each address; depth 0 is a prompt's first block."""
        old, new = self._known, {}
        seen: dict[BlockHash, tuple[int, int]] = {}  # every chain node met, cached or not
        for address in addresses:
            new[address] = _entry(address, old, seen)
        self._known = new
        return new


def _entry(
    address: BlockHash, old: dict[BlockHash, tuple[int, int]], seen: dict[BlockHash, tuple[int, int]]
) -> tuple[int, int]:
    """Walk up to the first known ancestor (iteratively: a chain is as deep as a context), then
    hash back down, remembering each node in ``seen``."""
    chain: list[BlockHash] = []
    node: BlockHash | None = address
    depth, digest = -1, ROOT
    while node is not None:
        hit = seen.get(node) or old.get(node)
        if hit is not None:
            depth, digest = hit
            break
        chain.append(node)
        node = node.parent
    for node in reversed(chain):
        depth, digest = depth + 1, _chain(digest, _tokens_bytes(node.tokens))
        seen[node] = (depth, digest)
    return depth, digest

"""Content addresses of full KV blocks: (parent block's address, the block's token ids).

A ``BlockHash`` keeps its parent and its tokens, and equality compares them (after the int
hash), so a dict lookup hit is always exact: no two different prefixes can share an address,
whatever the int hashes do. Chains built from cached parents compare parents by identity, so an
equality check costs one block's tokens, not the whole prefix.
"""

from __future__ import annotations

from collections.abc import Sequence


class BlockHash:
    """The address of one full block: its whole prefix, held by reference."""

    __slots__ = ("parent", "tokens", "value")

    def __init__(self, parent: BlockHash | None, tokens: tuple[int, ...]) -> None:
        self.parent = parent
        self.tokens = tokens
        self.value: int = hash((None if parent is None else parent.value, tokens))

    def __hash__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        a: BlockHash | None = self
        b = other
        while a is not b:  # iterative: a long prefix must not hit the recursion limit
            if not isinstance(b, BlockHash) or a is None or a.value != b.value or a.tokens != b.tokens:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        return f"BlockHash({self.value:#x}, {len(self.tokens)} tokens)"


def hash_block(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    return BlockHash(parent, tuple(tokens))

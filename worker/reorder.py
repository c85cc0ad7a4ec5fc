"""The persistent batch's reorder policy: SWAP moves that keep soon-finishing rows at the tail.

When a request finishes, the batch condenses by moving its highest rows into the hole; a request
that finishes in the last row needs no move at all. Ordering rows by remaining token budget
(most remaining first) puts the likely next finishers at the tail, so most finishes cost no
condense moves (and no processor state moves). Swaps are cheap: KV stays in its slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def tail_swaps(order: Sequence[str], remaining: Callable[[str], int], max_swaps: int = 8) -> list[tuple[int, int]]:
    """Swaps (selection sort, at most ``max_swaps``) towards descending ``remaining``; stable."""
    target = sorted(order, key=lambda rid: -remaining(rid))
    cur = list(order)
    pos = {rid: i for i, rid in enumerate(cur)}
    swaps: list[tuple[int, int]] = []
    for i, want in enumerate(target):
        if len(swaps) >= max_swaps:
            break
        if cur[i] == want:
            continue
        j = pos[want]
        cur[i], cur[j] = cur[j], cur[i]
        pos[cur[i]], pos[cur[j]] = i, j
        swaps.append((i, j))
    return swaps

"""The cache-aware choice, as a pure function of what the router knows (tested without Ray).

Among the candidate replicas whose load is within `imbalance_threshold` ongoing requests of the
least loaded one, prefer those holding the longest cached prefix of the request; ties are left to
Serve, which takes the least loaded of them. No preference (the request goes to the less loaded
of two random replicas, Serve's default) when the longest prefix is under `min_match_fraction`
of the request's blocks (a shared chat-template header is not a reason to pile every request on
one replica) or only overloaded replicas hold it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Reason = Literal["cache", "no_match", "imbalanced"]


@dataclass(frozen=True)
class Candidate:
    replica: str
    load: int  # ongoing requests
    matched: int  # leading blocks of the request cached (or guessed) there


@dataclass(frozen=True)
class Decision:
    preferred: tuple[str, ...]  # () = no preference: by load
    reason: Reason
    matched: int = 0  # blocks the preferred replicas hold


def decide(
    candidates: Sequence[Candidate], num_blocks: int, *, imbalance_threshold: int, min_match_fraction: float
) -> Decision:
    """``num_blocks``: the request's blocks that could be found cached."""
    best = max((c.matched for c in candidates), default=0)
    if best == 0 or best < min_match_fraction * num_blocks:
        return Decision((), "no_match")
    least = min(c.load for c in candidates)
    eligible = [c for c in candidates if c.load - least <= imbalance_threshold]
    top = max(c.matched for c in eligible)  # the least loaded candidate is always eligible
    if top == 0 or top < min_match_fraction * num_blocks:
        return Decision((), "imbalanced")
    return Decision(tuple(c.replica for c in eligible if c.matched == top), "cache", top)

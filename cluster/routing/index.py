"""The router's view of every replica's prefix cache: its last report, plus guesses.

A report (cluster.routing.report) replaces the replica's reported digests wholesale. A guess is
what routing a request to a replica implies: its prompt's blocks will be cached there once its
prefill ran, which the replica's next report says, one stats period later or more. Until then
the guess gives the next request with that prefix (a conversation's next turn, a tenant's next
question) the same replica. A guess lives `guess_ttl_s`, and leaves early once a report confirms
it (from then on the report decides, so an eviction the report shows is not hidden by a guess).
A replica whose reports stop for `stale_after_s` (killed, hung, restarted under a new id) loses
its whole entry: it is routed by load until it reports again. None of this is ever trusted for
correctness: a wrong entry sends a request where its prefix is not, a cache miss.

Owned by one router, on Serve's router event loop; nothing here is thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cluster.routing.report import RoutingReport


@dataclass
class _Entry:
    seen: float  # router clock: when the current report arrived (or the first guess was made)
    report: RoutingReport | None = None
    reported: set[int] = field(default_factory=set)
    guesses: OrderedDict[int, float] = field(default_factory=OrderedDict)  # digest -> expiry, oldest first


@dataclass(frozen=True)
class IndexSize:
    reported: int
    guessed: int


class PrefixIndex:
    def __init__(self, *, guess_ttl_s: float, stale_after_s: float, max_guesses: int) -> None:
        self.guess_ttl_s = guess_ttl_s
        self.stale_after_s = stale_after_s
        self.max_guesses = max_guesses  # per replica; the oldest go first
        self._entries: dict[str, _Entry] = {}

    def on_report(self, replica: str, report: RoutingReport | None, now: float) -> bool:
        """Take a replica's report; False when it is none or the one already held."""
        if report is None:
            return False
        entry = self._entries.get(replica)
        if entry is not None and entry.report is not None and entry.report.seq == report.seq:
            return False
        if entry is None:
            entry = self._entries[replica] = _Entry(seen=now)
        entry.report, entry.reported, entry.seen = report, report.digest_set(), now
        for digest in [d for d in entry.guesses if d in entry.reported]:
            del entry.guesses[digest]
        return True

    def guess(self, replica: str, digests: Iterable[int], now: float) -> None:
        """``digests`` will likely be cached on ``replica`` soon (a request with them went there)."""
        entry = self._live(replica, now)
        if entry is None:
            entry = self._entries[replica] = _Entry(seen=now)
        expiry = now + self.guess_ttl_s
        for digest in digests:
            if digest not in entry.reported:
                entry.guesses[digest] = expiry
                entry.guesses.move_to_end(digest)
        self._prune(entry, now)

    def unguess(self, replica: str, digests: Iterable[int]) -> None:
        """Take back guesses: the request they were made for went elsewhere."""
        entry = self._entries.get(replica)
        if entry is not None:
            for digest in digests:
                entry.guesses.pop(digest, None)

    def matched(self, replica: str, digests: Sequence[int], now: float) -> int:
        """How many of ``digests``, from the first, the replica holds (reported or guessed)."""
        entry = self._live(replica, now)
        if entry is None:
            return 0
        n = 0
        for digest in digests:
            if digest not in entry.reported and entry.guesses.get(digest, now) <= now:
                break
            n += 1
        return n

    def report(self, replica: str, now: float) -> RoutingReport | None:
        entry = self._live(replica, now)
        return None if entry is None else entry.report

    def retain(self, replicas: Iterable[str]) -> None:
        """Forget every replica not in ``replicas`` (drained, killed, replaced)."""
        keep = set(replicas)
        for replica in [r for r in self._entries if r not in keep]:
            del self._entries[replica]

    def drop(self, replica: str) -> None:
        self._entries.pop(replica, None)

    def sizes(self, now: float) -> dict[str, IndexSize]:
        """Blocks held per live replica (expired guesses pruned first)."""
        out = {}
        for replica in list(self._entries):
            entry = self._live(replica, now)
            if entry is not None:
                self._prune(entry, now)
                out[replica] = IndexSize(len(entry.reported), len(entry.guesses))
        return out

    def _live(self, replica: str, now: float) -> _Entry | None:
        entry = self._entries.get(replica)
        if entry is not None and now - entry.seen > self.stale_after_s:
            del self._entries[replica]
            return None
        return entry

    def _prune(self, entry: _Entry, now: float) -> None:
        guesses = entry.guesses
        while guesses and (len(guesses) > self.max_guesses or next(iter(guesses.values())) <= now):
            guesses.popitem(last=False)

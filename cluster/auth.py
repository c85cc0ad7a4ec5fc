"""Optional API keys: `Authorization: Bearer KEY` over HTTP, `authorization` metadata over gRPC."""

from __future__ import annotations

import hmac
from collections.abc import Iterable


class Unauthenticated(Exception):
    """Missing or wrong API key."""


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode() for k in keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raise Unauthenticated unless ``authorization`` is `Bearer <a configured key>`."""
        if not self._keys:
            return
        if not authorization or not authorization.startswith("Bearer "):
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
        given = authorization[len("Bearer "):].strip().encode()
        # Compare against every key in constant time; never short-circuit on a match.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise Unauthenticated("invalid API key")

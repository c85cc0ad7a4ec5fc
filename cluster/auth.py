"""Optional API keys: `Authorization: Bearer KEY` over HTTP, `authorization` metadata over gRPC."""

from __future__ import annotations

import hmac
from collections.abc import Iterable


class Unauthenticated(Exception):
    """Missing or wrong API key."""


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of `Bearer <token>`: the scheme in any case, spaces around it or the token
    ignored (RFC 9110 section 11.1); None for any other scheme or an empty token."""
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    token = credentials.strip()
    return token if scheme.lower() == "bearer" and token else None


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k.encode() for k in keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raise Unauthenticated unless ``authorization`` is `Bearer <a configured key>`; the
        scheme in any case, spaces around it or the key ignored (RFC 9110 section 11.1)."""
        if not self._keys:
            return
        given = bearer_token(authorization)
        if given is None:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>'")
        # Compare against every key in constant time; never short-circuit on a match.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(given.encode(), key)
        if not ok:
            raise Unauthenticated("invalid API key")

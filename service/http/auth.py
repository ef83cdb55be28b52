"""API keys: the Bearer token of a request and the comparison against the accepted keys,
shared by the HTTP guard (guard.py), the routes (app.py) and the arena socket (lease.py)."""

from __future__ import annotations

import hmac


def bearer_token(authorization: str | None) -> str | None:
    """RFC 6750's `Authorization: Bearer TOKEN` (the scheme case-insensitive, spaces around
    the token ignored); None for another scheme or no header."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def key_matches(given: bytes, keys: list[bytes]) -> bool:
    """Compare against every key (no early exit), each in constant time."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    return ok

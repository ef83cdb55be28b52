"""The Bearer token of a request (RFC 6750), read by the guard (guard.py) and the routes
(state.py); the key comparison itself is core.keys."""

from __future__ import annotations


def bearer_token(authorization: str | None) -> str | None:
    """RFC 6750's `Authorization: Bearer TOKEN` (the scheme case-insensitive, spaces around
    the token ignored); None for another scheme or no header."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None

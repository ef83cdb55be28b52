"""API-key comparison, shared by the HTTP guard (app.py) and the arena socket (lease.py)."""

from __future__ import annotations

import hmac


def key_matches(given: bytes, keys: list[bytes]) -> bool:
    """Compare against every key (no early exit), each in constant time."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    return ok

"""API keys compared against the accepted ones: the HTTP guard's check and the arena
socket's handshake (engine/lease.py) use the same comparison."""

from __future__ import annotations

import hmac


def key_matches(given: bytes, keys: list[bytes]) -> bool:
    """Compare against every key (no early exit), each in constant time."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given, key)
    return ok

"""The arena's allocator and the Reservation that owns each range (fast, no engine)."""

from __future__ import annotations

import random

import pytest

from hsx_service.engine.arena import ALIGN, Allocator, ArenaFull, ArenaTooSmall, Extent, FreeError


def test_first_fit_coalesces_back_to_one_free_range():
    a = Allocator(64 * ALIGN)
    rng = random.Random(0)
    live = []
    for _ in range(500):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(a.allocate(rng.randrange(1, 6 * ALIGN)))
            except ArenaFull:
                pass
        assert a.used == sum(e.reserved for e in live)
    for e in live:
        a.free(e)
    assert a.used == 0 and a.allocate(64 * ALIGN).offset == 0  # one range again
    with pytest.raises(ArenaTooSmall):
        a.allocate(64 * ALIGN + 1)


def test_double_and_foreign_frees_are_refused():
    a = Allocator(16 * ALIGN)
    e = a.allocate(100)
    other = a.allocate(ALIGN)
    a.free(e)
    with pytest.raises(FreeError, match="not allocated"):
        a.free(e)  # a double free would hand one range to two requests
    with pytest.raises(FreeError, match="not allocated"):
        a.free(Extent(8 * ALIGN, 10))  # never handed out
    with pytest.raises(FreeError, match=f"allocated with {ALIGN} bytes, freed with {2 * ALIGN}"):
        a.free(Extent(other.offset, 2 * ALIGN))
    a.free(other)
    assert a.used == 0


def test_a_reservation_frees_once_and_hands_over_explicitly():
    a = Allocator(16 * ALIGN)
    r = a.reserve(10)
    assert r.owned and a.used == ALIGN
    r.release()
    r.release()  # idempotent: every cleanup path may call it
    assert a.used == 0 and not r.owned

    r = a.reserve(10)
    lease = r.hand_over()
    r.release()  # the old owner's release does nothing now
    assert a.used == ALIGN and lease.owned and not r.owned
    with pytest.raises(RuntimeError, match="handed over"):
        r.hand_over()
    lease.release()
    assert a.used == 0
    with pytest.raises(RuntimeError, match="released"):
        lease.hand_over()

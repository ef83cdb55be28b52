"""Issue 36.1, fast: who gets the next tokenizer process (hsx_service.tokenize_slots), and how
the guard names a client. No processes: each "request" holds its turn until the test lets it
go. The same flood against a real server is in tests/service/http/test_generation_route.py."""

from __future__ import annotations

import asyncio

import pytest

from hsx_service.core.admission import AdmissionGate
from hsx_service.http.guard import GuardMiddleware
from hsx_service.core.metrics import Metrics
from hsx_service.settings import ServiceSettings
from hsx_service.tokenize_slots import FairSlots, LaneFull


class Requests:
    """Requests on `slots`: each takes its turn, records it, and holds it until released."""

    def __init__(self, slots: FairSlots) -> None:
        self.slots = slots
        self.started: list[str] = []
        self._go: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def send(self, name: str, client: str, long: bool = False) -> asyncio.Task:
        self._go[name] = asyncio.Event()

        async def one() -> None:
            async with self.slots.hold(client, long):
                self.started.append(name)
                await self._go[name].wait()

        self.tasks[name] = asyncio.ensure_future(one())
        return self.tasks[name]

    async def finish(self, name: str) -> None:
        self._go[name].set()
        await self.tasks[name]

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)


async def test_another_client_gets_the_next_process_before_a_flood_s_waiting_requests():
    """The issue's stall: one client's requests queued ahead of another's first-in-first-out."""
    r = Requests(FairSlots(processes=2, places=34))
    for i in range(12):
        r.send(f"flood{i}", "peer:a")
    await r.settle()
    r.send("small", "peer:b")
    await r.settle()
    assert r.started == ["flood0", "flood1"]  # a client alone uses every process
    await r.finish("flood0")
    await r.settle()
    assert r.started[-1] == "small"  # not behind flood2..flood11
    await r.finish("flood1")
    await r.settle()
    assert r.started[-1] == "flood2"
    for name in ["small"] + [f"flood{i}" for i in range(2, 12)]:
        await r.finish(name)
    assert r.slots.busy == 0 and not r.slots.running and not r.slots.held


async def test_long_texts_never_take_the_last_process():
    r = Requests(FairSlots(processes=2, places=34))
    for i in range(4):
        r.send(f"long{i}", "peer:a", long=True)
    await r.settle()
    assert r.started == ["long0"]  # one process is left to texts that fit
    r.send("small", "peer:a")  # whoever sends them: the same client's short one runs at once
    await r.settle()
    assert r.started == ["long0", "small"]
    await r.finish("long0")
    await r.settle()
    assert r.started[-1] == "long1"
    for name in ("small", "long1", "long2", "long3"):
        await r.finish(name)
    alone = Requests(FairSlots(processes=1, places=4))  # with one process, nothing is kept
    alone.send("long", "peer:a", long=True)
    await alone.settle()
    assert alone.started == ["long"]
    await alone.finish("long")


async def test_a_flood_cannot_fill_the_lane_and_a_refusal_says_why():
    slots = FairSlots(processes=2, places=6)  # 2 processes + 4 waiting: the last 2 kept for others
    r = Requests(slots)
    for i in range(4):
        r.send(f"a{i}", "peer:a")
    await r.settle()
    with pytest.raises(LaneFull, match="kept for other clients"):
        slots.check_place("peer:a")
    r.send("b0", "peer:b")
    r.send("c0", "peer:c")
    await r.settle()
    with pytest.raises(LaneFull, match=r"limit 6"):
        slots.check_place("peer:d")
    for name in ("a0", "a1", "a2", "a3", "b0", "c0"):
        await r.finish(name)
    # Without waiting places nothing can be kept: a client alone still uses every process.
    lone = FairSlots(processes=2, places=2)
    r = Requests(lone)
    r.send("x", "peer:a")
    r.send("y", "peer:a")
    await r.settle()
    assert r.started == ["x", "y"]
    for name in ("x", "y"):
        await r.finish(name)


async def test_a_request_cancelled_waiting_or_just_granted_gives_its_place_and_process_back():
    slots = FairSlots(processes=1, places=8)
    r = Requests(slots)
    r.send("running", "peer:a")
    waiting = r.send("waiting", "peer:b")
    await r.settle()
    waiting.cancel()
    await r.settle()
    assert slots.busy == 1 and "peer:b" not in slots.held
    granted = r.send("granted", "peer:c")
    await r.settle()
    await r.finish("running")  # the turn goes to "granted"; it is cancelled before it runs
    granted.cancel()
    await r.settle()
    assert slots.busy == 0 and slots.free == 1 and not slots.running
    r.send("after", "peer:a")
    await r.settle()
    assert r.started[-1] == "after"
    await r.finish("after")


@pytest.mark.parametrize("keys, auth, peer, expected_prefix", [
    ([], None, ("127.0.0.2", 5555), "peer:127.0.0.2"),
    ([], "Bearer chosen-name", ("127.0.0.2", 5556), "peer:127.0.0.2"),  # no keys: a name is not a client
    (["k1"], "Bearer k1", ("127.0.0.2", 5557), "key:"),
])
def test_the_guard_names_a_client_by_its_key_else_its_address(keys, auth, peer, expected_prefix):
    settings = ServiceSettings(api_key=keys)
    guard = GuardMiddleware(None, settings, AdmissionGate(1, 1, Metrics()), Metrics())
    name = guard._client({"client": peer}, {"authorization": auth} if auth else {})
    assert name.startswith(expected_prefix)
    if keys:
        assert "k1" not in name and name != guard._client({"client": peer}, {"authorization": "Bearer k2"})

"""Who gets the next tokenizer process of a lane (tokenize_pool.py): fair among clients.

A request is handed to the process pool only once a process is free for it, so the order is
decided here, not by the pool's first-in-first-out queue (in which one client's flood of
requests ahead of another's made that one wait for all of them):
- the next free process goes to the waiting request whose client holds the fewest processes
  (the oldest first among equals): a client that holds every process keeps them only while no
  other client waits;
- a long text (one that could not fit the token limit uncut) never takes the last free
  process: one is always left to texts that fit, whoever sends the long ones;
- a lane holds at most `places` requests (running or waiting; 503 beyond), and a client that
  already has requests here may not take its last few places (as many as the processes, at
  most the waiting places): those are kept for clients that have none, so one client's flood
  cannot fill the lane either (and a client alone can still use every process).
A client is its API key where the server has keys, else its address (guard.py names it).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass


class LaneFull(Exception):
    """No place for this request in the lane; the message says why."""


@dataclass(eq=False)
class _Waiter:
    seq: int
    client: str
    long: bool
    turn: asyncio.Future


class FairSlots:
    def __init__(self, processes: int, places: int) -> None:
        self.processes = processes
        self.places = max(places, processes)
        self.kept = min(processes, self.places - processes)  # places kept for clients with none here
        self.busy = 0  # requests in the lane: running or waiting
        self.held: Counter[str] = Counter()  # places by client
        self.running: Counter[str] = Counter()  # processes by client
        self.long_running = 0
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def free(self) -> int:
        return self.processes - sum(self.running.values())

    def check_place(self, client: str) -> None:
        """Raises LaneFull when this client may not take a place now."""
        if self.busy >= self.places:
            raise LaneFull(f"{self.busy} requests are waiting or running (limit {self.places})")
        if self.held[client] and self.busy >= self.places - self.kept:
            raise LaneFull(f"this client has {self.held[client]} of the {self.busy} requests here; the last "
                           f"{self.kept} places are kept for other clients")

    @asynccontextmanager
    async def hold(self, client: str, long: bool = False) -> AsyncIterator[None]:
        """A place, then a process, held for the block; raises LaneFull at once when there is no
        place. Cancelling while waiting gives both back."""
        self.check_place(client)
        self.busy += 1
        self.held[client] += 1
        try:
            await self._turn(client, long)
            try:
                yield
            finally:
                self._give_back(client, long)
        finally:
            self.busy -= 1
            self.held[client] -= 1
            if not self.held[client]:
                del self.held[client]

    async def _turn(self, client: str, long: bool) -> None:
        waiter = _Waiter(next(self._seq), client, long, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        self._dispatch()
        try:
            await waiter.turn
        except asyncio.CancelledError:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif not waiter.turn.cancelled():  # granted a process, then cancelled before it ran
                self._give_back(client, long)
            raise

    def _give_back(self, client: str, long: bool) -> None:
        self.running[client] -= 1
        if not self.running[client]:
            del self.running[client]
        self.long_running -= long
        self._dispatch()

    def _may_run(self, waiter: _Waiter) -> bool:
        # A long text may not take the last free process (with one process, nothing is kept).
        return not waiter.long or self.processes == 1 or self.long_running < self.processes - 1

    def _dispatch(self) -> None:
        # A waiter cancelled before its turn came may still be listed until its task runs.
        self._waiting = [w for w in self._waiting if not w.turn.cancelled()]
        while self.free > 0:
            ready = [w for w in self._waiting if self._may_run(w)]
            if not ready:
                return
            waiter = min(ready, key=lambda w: (self.running[w.client], w.seq))
            self._waiting.remove(waiter)
            self.running[waiter.client] += 1
            self.long_running += waiter.long
            waiter.turn.set_result(None)

"""The API process's side of one chunked save (chunks.py): the stream window of a request
whose states exceed `--stream-window-bytes`.

It owns the window's arena range and frees it only when all three hold: the worker said
`end` (it writes the window no more), the response is closed, and no chunk is still out
(being sent, or under a lease). Chunks are handed out in order as their notices land;
`give_back(chunk)` credits the chunk's slot to the worker so it can copy a later chunk.
A response closed early sends a cancel: the worker stops copying, ends, and frees the
request's KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from hsx_service.engine.arena import Extent, Reservation
from hsx_service.engine.chunks import ChunkPlan, CreditSender, chunk_range, num_chunks

log = logging.getLogger("hsx.window")


class ChunkFailed(Exception):
    """The worker ended the save before this chunk (an engine failure or a cancel)."""


class ChunkCut(ChunkFailed):
    """The server stopped waiting for this save's chunks (the drain's --shutdown-timeout)."""


@dataclass(frozen=True)
class Chunk:
    index: int
    slot: int
    start: int  # first token
    stop: int  # one past the last
    offset: int  # in the arena
    nbytes: int


class StreamWindow:
    def __init__(self, reservation: Reservation, plan: ChunkPlan, num_tokens: int, credits: CreditSender,
                 end_timeout: float, on_give_up: Callable[[str], None] | None = None) -> None:
        self.reservation = reservation
        self.plan = plan
        self.num_tokens = num_tokens
        self.total = num_chunks(num_tokens, plan.chunk_tokens)
        self.key = ""  # set when the request is submitted
        self._credits = credits
        self._end_timeout = end_timeout
        self._landed: dict[int, int] = {}  # chunk -> slot, landed and not yet handed out
        self._next = 0  # the next chunk to hand out
        self._out: dict[int, int] = {}  # chunk -> slot, handed out and not given back
        self._changed = asyncio.Event()
        self.ended = False
        self.error: str | None = None
        self.closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._on_give_up = on_give_up  # told the key when no end notice came in time
        self.stopped: str | None = None  # why no more chunks are handed out (`stop`)
        self._on_free: list[Callable[[], None]] = []
        self._cut: str | None = None  # why the drain stopped waiting (`cut`)

    @property
    def extent(self) -> Extent:
        """The window's arena range (what a lease cap counts)."""
        return self.reservation.extent

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.plan.token_bytes

    def on_notice(self, msg: dict) -> None:
        """A message of the completion channel for this save (notices.Notices)."""
        if msg.get("end") or not msg.get("ok"):
            self.ended = True
            if not msg.get("ok"):
                self.error = msg.get("error") or "failed"
        elif "chunk" in msg:
            self._landed[int(msg["chunk"])] = int(msg["slot"])
        self._changed.set()
        self._maybe_free()

    async def first(self) -> None:
        """Wait until the first chunk landed or the save ended; raises ChunkFailed on an error."""
        while 0 not in self._landed and not self.ended:
            self._changed.clear()
            await self._changed.wait()
        if 0 not in self._landed:
            raise ChunkFailed(self.error or "ended before its first chunk")

    async def next_chunk(self) -> Chunk | None:
        """The next chunk once it has landed (it is then out until `give_back`); None after the
        last. Raises ChunkFailed when the worker ended first."""
        if self._next >= self.total:
            return None
        index = self._next
        while self.stopped is None and index not in self._landed:
            if self.ended:
                raise ChunkFailed(self.error or f"the save ended before chunk {index}")
            self._changed.clear()
            await self._changed.wait()
        if self.stopped is not None:
            raise (ChunkCut if self._cut is not None else ChunkFailed)(self.stopped)
        slot = self._landed.pop(index)
        self._out[index] = slot
        self._next += 1
        start, stop = chunk_range(index, self.num_tokens, self.plan.chunk_tokens)
        return Chunk(index, slot, start, stop, self.plan.slots[slot], (stop - start) * self.plan.token_bytes)

    def give_back(self, index: int) -> None:
        """Chunk `index` was sent (or its lease ended): its slot is the worker's again."""
        slot = self._out.pop(index, None)
        if slot is None:
            return
        self._changed.set()  # all_back() waits on it
        if not self.ended:
            self._credits.credit(self.key, slot)
        self._maybe_free()

    async def all_back(self) -> None:
        """Wait until every chunk handed out is given back (sent, or its lease ended), or
        the window is cut."""
        while self._out and self._cut is None:
            self._changed.clear()
            await self._changed.wait()

    def cut(self, reason: str) -> None:
        """The drain's cut-off: `stop`, with `next_chunk` raising ChunkCut (a 503 record)."""
        if self.stopped is None:
            self._cut = reason
        self.stop(reason)

    @property
    def complete(self) -> bool:
        return self._next >= self.total

    def close(self) -> None:
        """The response is done with the window (sent, failed or left): cancel what is left and
        free the range once the worker ended and every chunk is back."""
        if self.closed:
            return
        self.closed = True
        if not self.key:  # never submitted: nothing writes the window
            self.ended = True
        if not self.ended:
            self._credits.cancel(self.key)
        if not self.ended:
            self._timer = asyncio.get_running_loop().call_later(self._end_timeout, self._give_up)
        self._maybe_free()

    release = close  # serving's cleanup calls it as it does a Reservation's

    def stop(self, reason: str) -> None:
        """End the request now (a chunk lease expired: its client stopped reading): no more
        chunks are handed out (`next_chunk` raises ChunkFailed with `reason`), the worker is
        told to cancel (it ends and frees the request's KV blocks), and the range is freed once
        it has ended and every chunk is back."""
        if self.stopped is None:
            self.stopped = reason
            self._changed.set()
        self.close()

    def when_freed(self, fn: Callable[[], None]) -> None:
        """Run `fn` once the window's range is freed (a lease stream's hold on the caps)."""
        if self.reservation.owned:
            self._on_free.append(fn)
        else:
            fn()

    def _give_up(self) -> None:
        log.warning("no end notice for chunked save %s; freeing its window after timeout", self.key[:8])
        self.ended = True
        self._out.clear()
        if self._on_give_up is not None:
            self._on_give_up(self.key)
        self._maybe_free()

    def _maybe_free(self) -> None:
        if self.closed and self.ended and not self._out:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.reservation.release()
            on_free, self._on_free = self._on_free, []
            for fn in on_free:
                fn()


class WindowStates:
    """The states of a chunked save as a streamed body part (body/response.StreamedPart):
    each chunk's bytes, read from the arena, given back once read."""

    def __init__(self, window: StreamWindow, arena_view: memoryview) -> None:
        self.window = window
        self.nbytes = window.nbytes
        self._view = arena_view

    async def pieces(self) -> AsyncIterator[tuple[memoryview, Callable[[], None]]]:
        while (chunk := await self.window.next_chunk()) is not None:
            yield self._view[chunk.offset : chunk.offset + chunk.nbytes], functools.partial(
                self.window.give_back, chunk.index)


class ChunkLease:
    """A chunk's slot as a lease's range (engine/lease.Leases owns it like a Reservation):
    ending the lease gives the chunk back to the window."""

    def __init__(self, window: StreamWindow, chunk: Chunk) -> None:
        self.extent = Extent(chunk.offset, chunk.nbytes)
        self._give_back = functools.partial(window.give_back, chunk.index)

    def release(self) -> None:
        self._give_back()  # once: the window ignores a chunk already back

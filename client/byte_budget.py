"""The client's memory budget (`hsx extract --max-buffer-bytes`, issue 29): the bytes of
responses it may hold in flight at once. A sample streams through a buffer of its own
(hsx_client.sample_stream), so a request is admitted once its buffer fits; one larger than
the whole budget is admitted alone (it still streams through, never held whole)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

# The default budget's share of the memory this process may still use: the rest stays for
# the interpreter, torch, the page cache of the files being written and other processes.
DEFAULT_SHARE = 0.25
# A stream's bytes beyond its chunk buffer: the socket reader's buffer (aiohttp pauses
# reading past 2 x 64 KiB) and a zstd batch with its output (sample_stream.ZSTD_BATCH).
STREAM_OVERHEAD = 2 << 20


def _cgroup_room() -> int | None:
    """What the cgroup (v2, else v1) still lets this process tree use; None without a limit."""
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_f).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            return max(0, int(raw) - int(Path(usage_f).read_text().strip()))
        except (OSError, ValueError):
            continue
    return None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def default_max_buffer_bytes() -> int:
    """A quarter of what the machine (or the container's cgroup) has available now, at
    least 64 MiB."""
    room = [r for r in (_mem_available(), _cgroup_room()) if r is not None]
    avail = min(room) if room else (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return max(64 << 20, int(avail * DEFAULT_SHARE))


def stream_chunk_bytes(budget: int, streams: int, cap: int) -> int:
    """The chunk buffer of one stream when `streams` share `budget`: at most `cap`, at
    least 256 KiB (smaller chunks cost more in per-chunk work than they save)."""
    share = budget // max(1, streams) - STREAM_OVERHEAD
    return max(256 << 10, min(cap, share))


class ByteBudget:
    """Bytes held against a limit; `acquire(n)` waits until they fit (or nothing is held)."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"a memory budget must be positive, not {limit}")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._changed: asyncio.Condition | None = None

    async def acquire(self, n: int) -> None:
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            await self._changed.wait_for(lambda: self.held == 0 or self.held + n <= self.limit)
            self.held += n
            self.peak = max(self.peak, self.held)

    def take(self, n: int) -> None:
        """`n` bytes held now, without waiting (bytes already in memory: a lease's states taken
        out, bounded by the server's stream window); later admissions wait for them."""
        self.held += n
        self.peak = max(self.peak, self.held)

    async def release(self, n: int) -> None:
        assert self._changed is not None
        async with self._changed:
            self.held -= n
            self._changed.notify_all()

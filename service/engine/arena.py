"""A shared-memory arena between the API process and vLLM's workers.

The API process owns the arena and its allocator: it knows each request's token
count before submitting it, so it reserves the exact byte range the worker will
fill and passes the offset with the request. The worker copies the states
straight into that range (on CUDA, from the GPU into the registered, page-locked
mapping); the API process then sends the bytes from the same mapping. No file,
no lock file, no serialize/deserialize, and the arena size bounds the memory that
unsent responses can hold. Each range is owned by one `Reservation` at a time.
"""

from __future__ import annotations

import bisect
import mmap
import os
import uuid
from dataclasses import dataclass

ALIGN = 4096


class ArenaFull(Exception):
    """No free range is large enough right now (try again later)."""


class ArenaTooSmall(ValueError):
    """The request can never fit, whatever is freed."""


@dataclass(frozen=True)
class Extent:
    offset: int
    nbytes: int  # bytes asked for (the reservation is rounded up to ALIGN)

    @property
    def reserved(self) -> int:
        return _round_up(self.nbytes)


def _round_up(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


class FreeError(RuntimeError):
    """A range freed twice, or one this allocator never handed out: a bug that would let
    two requests share memory, so it is refused loudly."""


class Allocator:
    """First-fit over a sorted free list with coalescing; single-threaded (event loop).

    It remembers what it handed out, so `free` of a range that is not out (a double
    free, or a foreign or mis-sized extent) raises FreeError instead of corrupting the
    free list."""

    def __init__(self, size: int):
        self.size = size // ALIGN * ALIGN
        self._starts: list[int] = [0]
        self._lengths: dict[int, int] = {0: self.size}
        self._taken: dict[int, int] = {}  # offset -> reserved length of every range out
        self.used = 0

    def allocate(self, nbytes: int) -> Extent:
        need = _round_up(nbytes)
        if need > self.size:
            raise ArenaTooSmall(f"{nbytes} bytes exceed the whole arena ({self.size} bytes)")
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length >= need:
                del self._lengths[start]
                self._starts.pop(i)
                if length > need:
                    self._starts.insert(i, start + need)
                    self._lengths[start + need] = length - need
                self.used += need
                self._taken[start] = need
                return Extent(start, nbytes)
        raise ArenaFull(f"{nbytes} bytes asked, {self.size - self.used} free but fragmented or taken")

    def reserve(self, nbytes: int) -> "Reservation":
        return Reservation(self, self.allocate(nbytes))

    def free(self, extent: Extent) -> None:
        start, length = extent.offset, extent.reserved
        if self._taken.get(start) != length:
            what = "not allocated (a double free?)" if start not in self._taken else \
                f"allocated with {self._taken[start]} bytes, freed with {length}"
            raise FreeError(f"arena range at offset {start} is {what}")
        del self._taken[start]
        self.used -= length
        i = bisect.bisect_left(self._starts, start)
        # Merge with the following free range.
        if i < len(self._starts) and self._starts[i] == start + length:
            length += self._lengths.pop(self._starts.pop(i))
        # Merge with the preceding free range.
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:
            self._lengths[self._starts[i - 1]] += length
            return
        self._starts.insert(i, start)
        self._lengths[start] = length


class Reservation:
    """The one owner of an arena range.

    A request's range has three possible owners over its life: the request (its
    response body reads the range), the engine (after a failure the worker may still
    write it until the connector's notice), and a same-host lease (the client reads it).
    Whoever holds the live Reservation frees the range, with `release()`, which frees
    it once (later calls do nothing). `hand_over()` moves the range to a new
    Reservation for the next owner; the old one's `release()` then does nothing, so the
    request's cleanup path can always call it."""

    __slots__ = ("_allocator", "extent", "_state")

    def __init__(self, allocator: Allocator, extent: Extent) -> None:
        self._allocator = allocator
        self.extent = extent
        self._state = "owned"  # -> "released" | "handed_over"

    @property
    def owned(self) -> bool:
        return self._state == "owned"

    def release(self) -> None:
        if self._state == "owned":
            self._state = "released"
            self._allocator.free(self.extent)

    def hand_over(self) -> "Reservation":
        if self._state != "owned":
            raise RuntimeError(f"cannot hand over an arena range that is {self._state.replace('_', ' ')}")
        self._state = "handed_over"
        return Reservation(self._allocator, self.extent)


class SharedArena:
    """The mapping itself. `create` in the API process, `attach` in a worker."""

    def __init__(self, path: str, size: int, mm: mmap.mmap, ro_fd: int | None = None):
        self.path = path
        self.size = size
        self.mm = mm
        self.view = memoryview(mm)
        # A read-only descriptor of the same file, kept for same-host clients (lease.py):
        # it stays valid after the name is unlinked and cannot be used to write.
        self.ro_fd = ro_fd
        self.arena_id = uuid.uuid4().hex

    @classmethod
    def create(cls, directory: str, size: int) -> "SharedArena":
        size = size // ALIGN * ALIGN
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"shared-memory directory {directory!r} does not exist (--shm-dir)")
        path = os.path.join(directory, f"hsx-arena-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)  # sparse: pages are only taken when written
            mm = mmap.mmap(fd, size)
            ro_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(fd)
        return cls(path, size, mm, ro_fd)

    @classmethod
    def attach(cls, path: str, size: int) -> "SharedArena":
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, size, mm)

    def unlink(self) -> None:
        """Remove the name; the mappings stay valid. Called once workers attached,
        so a crash of any process leaves nothing behind in /dev/shm."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def slice(self, extent: Extent) -> memoryview:
        return self.view[extent.offset : extent.offset + extent.nbytes]

    def close(self) -> None:
        self.unlink()
        if self.ro_fd is not None:
            os.close(self.ro_fd)
            self.ro_fd = None
        try:
            self.view.release()
            self.mm.close()
        except BufferError:
            # A response still holds a view; the OS frees the mapping at exit.
            pass

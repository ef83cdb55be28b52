"""Large freed blocks stay in the process (glibc), for the processes that receive bodies.

A /hidden_states body is 30-70 MB (2048 tokens x 4 layers x 2048-4096 hidden, bf16) and
the client assembles each one in a fresh buffer. glibc serves an allocation above its
mmap threshold (at most 32 MiB, so every such body) with a new mmap, which the kernel
fills page by page on first touch (a fault and a zeroed 4 KiB page each) and unmaps on
free: the next body pays again. Measured on the CI-class Xeon (2026-12-02): joining 64 MiB
bodies cost 0.52 CPU s/GB that way and 0.12 with the two settings below, at the same peak
RSS; `hsx bench --transport-only` figures in bench/README.md.

- M_MMAP_MAX = 0: large blocks come from the heap, where a freed block is reused;
- M_TRIM_THRESHOLD = 1 GiB: free memory at the heap's top is kept up to that much rather
  than handed back (and faulted in again) after every body;
- M_ARENA_MAX = 1: every thread allocates from that one heap. A thread's own arena is a
  64 MiB heap that cannot hold a 67 MB body, so glibc maps it fresh anyway: zstd decoding
  (a thread of the loop's executor) faulted ~220k pages per 12 x 64 MiB bodies, 0 with
  this, 1.43 -> 1.03 CPU s/GB. The few large allocations per second do not contend; the
  many small ones are Python's own (pymalloc), which does not use malloc's arenas.

The process's RSS then stays at its peak (bounded by the bodies in flight, as before)
instead of falling between bodies. Only hsx's own processes call this (`hsx extract` and
its worker processes, the bench's client): HsxClient as a library leaves a user's
process as it is. Elsewhere (not glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = 1 << 30


def keep_large_blocks() -> bool:
    """Apply the settings above; True when glibc took them all."""
    if platform.libc_ver()[0] != "glibc":  # musl and others: none of these knobs
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    took = [mallopt(M_MMAP_MAX, 0), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD), mallopt(M_ARENA_MAX, 1)]
    return took == [1, 1, 1]

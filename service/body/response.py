"""The response body: a safetensors file streamed from the arena, coded as negotiated
(negotiate.choose_coding: identity, zstd content coding, or the bf16split media type).

The header is built here (hsx.wire), the hidden-state bytes are read straight from
the shared arena: compressed chunk by chunk in worker threads (zstandard releases
the GIL, so chunks of many responses compress on all cores while the event loop
keeps serving), or, uncompressed, copied out in small chunks so the transport never
holds a view of arena memory that is about to be reused. A stream, once closed
(`aclose`), no longer reads the arena: the caller frees the range after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import zstandard

CHUNK = 4 << 20  # bytes of input per zstd frame / per identity write


class StreamedPart(Protocol):
    """A part whose bytes arrive in pieces (a chunked sample's states, engine/window.py):
    `pieces()` yields (bytes, done), in order; `done()` must run once nothing reads them."""

    nbytes: int

    def pieces(self) -> AsyncIterator[tuple[memoryview, Callable[[], None]]]: ...


@dataclass
class Body:
    parts: list  # bytes / memoryview / StreamedPart, in body order

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes if hasattr(p, "pieces") else len(p) for p in self.parts)

    def chunks(self) -> list[memoryview]:
        out = []
        for part in self.parts:
            view = memoryview(part).cast("B")
            for i in range(0, len(view), CHUNK):
                out.append(view[i : i + CHUNK])
        return out

    async def pieces(self) -> AsyncIterator[tuple[memoryview, Callable[[], None] | None]]:
        """(CHUNK-sized view, what to run once it has been read, or None), in body order."""
        for part in self.parts:
            if not hasattr(part, "pieces"):
                for view in Body([part]).chunks():
                    yield view, None
                continue
            async with contextlib.aclosing(part.pieces()) as pieces:
                async for piece, done in pieces:
                    views = Body([piece]).chunks()
                    try:
                        for i, view in enumerate(views[:-1]):
                            yield view, None
                    except BaseException:  # closed before its last view: nothing reads the piece now
                        done()
                        raise
                    yield views[-1], done


class Stats:
    """What the streamer saw, read by metrics once the body is done."""

    def __init__(self) -> None:
        self.raw = 0
        self.wire = 0
        self.complete = False  # every byte handed to the server
        self.work_s = 0.0  # seconds of pool time spent copying / compressing this body


_work_lock = threading.Lock()  # pieces of one body finish in parallel threads


def timed(stats: Stats, fn):
    """`fn` whose run time (in its pool thread) adds to `stats.work_s`."""

    def run(*args):
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            with _work_lock:
                stats.work_s += time.perf_counter() - t

    return run


def _copy_out(chunk: memoryview, last: bool) -> memoryview:
    # numpy releases the GIL for the copy, so many responses copy in parallel threads.
    return memoryview(np.frombuffer(chunk, dtype=np.uint8).copy())


async def _pipelined(body: Body, stats: Stats, step, executor: Executor | None) -> AsyncIterator:
    """Run `step(chunk, is_last)` on each chunk in a worker thread, in order, one at a
    time (a compressor is stateful), sending chunk i while chunk i+1 is processed (or,
    for a streamed part, awaited). The last step gets an empty chunk. A piece's `done`
    runs once its step has read it. However it ends, it waits for the step in flight,
    so that once it is closed nothing reads the body's memory any more."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Future | None = None
    async with contextlib.aclosing(body.pieces()) as pieces:
        try:
            async for chunk, after in pieces:
                try:  # shielded: a cancel here must not end the step while it reads the previous piece
                    done = await asyncio.shield(pending) if pending is not None else None
                except BaseException:
                    if after is not None:  # this piece was never read: it is given back
                        after()
                    raise
                stats.raw += len(chunk)
                pending = loop.run_in_executor(executor, timed(stats, step), chunk, False)
                if after is not None:
                    pending.add_done_callback(lambda _f, after=after: after())
                if done:
                    stats.wire += len(done)
                    yield done
            for last in (False, True):  # the last piece's output, then the end (a zstd frame's epilogue)
                done = await asyncio.shield(pending) if pending is not None else None
                pending = None if last else loop.run_in_executor(executor, timed(stats, step), memoryview(b""), True)
                if done:
                    stats.wire += len(done)
                    yield done
            stats.complete = True
        finally:
            if pending is not None and not pending.done():
                try:
                    await asyncio.shield(pending)
                except Exception:
                    pass


def stream_identity(body: Body, stats: Stats, executor: Executor | None = None) -> AsyncIterator[memoryview]:
    """Copies, off the event loop: the transport may keep a chunk after write() returns,
    and the arena range is reused as soon as the body ends."""
    return _pipelined(body, stats, _copy_out, executor)


def stream_zstd(body: Body, stats: Stats, level: int, executor: Executor | None,
                frame_threads: int = 0) -> AsyncIterator[bytes]:
    """One zstd frame for the whole body (httpx's decoder cannot restart between frames
    that end on a chunk boundary); many responses compress in parallel on `executor`
    (the server's compress pool, service/body/compress.py), and with `frame_threads` > 0 the
    frame's own blocks on that many zstd threads too (one frame still: zstd's multithreaded
    mode), so that one body is not one core's work: the last bodies of a run, or of a
    burst, wait on that alone."""
    cobj = zstandard.ZstdCompressor(level=level, threads=frame_threads).compressobj(size=body.nbytes)
    return _pipelined(body, stats, functools.partial(_compress_step, cobj), executor)


def _compress_step(cobj, chunk: memoryview, last: bool) -> bytes:
    out = cobj.compress(chunk) if len(chunk) else b""
    if last:
        out += cobj.flush()
    return out

"""Compressed response bodies on a pool of their own, with bounded memory.

One `CompressPool` per server: a thread pool sized to the cores left free by the
engine (`--compress-threads`), separate from the default executor so that tokenizing,
identity copies and compression never queue behind one another, and one global bound
on pieces being coded (`--compress-inflight`, x 4 MiB of input plus its output).

Two codings:
- `Content-Encoding: zstd` (response.stream_zstd): one zstd frame per body, its steps
  run in order on this pool; many bodies compress in parallel. One frame because httpx's
  decoder (0.28) breaks on a frame that ends exactly at a read boundary, and a third
  party's httpx must read our bodies.
- `application/vnd.hsx.bf16split+safetensors` (`stream_bf16split`, hsx/bf16split.py):
  many independent frames, so the pieces of *one* body are coded concurrently, up to
  `window` ahead of the socket, and sent in order.
Zstandard and numpy release the GIL: the event loop keeps serving while the pool works.
However a stream ends, it waits for its pieces in flight, so once it is closed nothing
reads the arena range any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import zstandard

from hsx import bf16split
from hsx.host import usable_cores
from hsx.wire import TensorSpec, encode_header
from hsx_service.body.response import timed

PIECE = bf16split.PIECE


def default_threads() -> int:
    """Cores free of the engine: its core process and the API's event loop keep two."""
    return max(1, usable_cores() - 2)


FRAME_THREADS_MIN_CORES = 8


def default_frame_threads(cores: int | None = None) -> int:
    """zstd threads per body when `--zstd-frame-threads` is unset: 2 on hosts with >= 8 cores,
    else 0. Measured: on the 16-core H200 host 2 threads cut compression from 0.235 to 0.12 s
    per 67 MB body (8B shape, 2026-12-02), part of the runs at 0.919x / 0.921x of plain
    prefill; on the 2-core CI box they cost more than they saved."""
    cores = usable_cores() if cores is None else cores
    return 2 if cores >= FRAME_THREADS_MIN_CORES else 0


class CompressPool:
    def __init__(self, threads: int, inflight: int, level: int = 1, window: int = 4,
                 frame_threads: int | None = 0) -> None:
        self.threads = threads
        self.inflight = max(1, inflight)
        self.level = level
        self.window = max(1, min(window, self.inflight))
        # zstd threads per zstd-coded body (response.stream_zstd); None: the host's default
        self.frame_threads = default_frame_threads() if frame_threads is None else frame_threads
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="hsx-compress")
        self._slots: asyncio.Semaphore | None = None  # made on the serving loop

    @property
    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.inflight)
        return self._slots

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class _Stats:  # the protocol of response.Stats (raw, wire, complete)
    raw: int
    wire: int
    complete: bool


Task = tuple[memoryview, Callable[[memoryview], bytes], "Callable[[], None] | None"]  # view, coder, after


async def _listed(tasks: Iterable[Task]) -> AsyncIterator[Task]:
    for task in tasks:
        yield task


async def _in_order(tasks: AsyncIterable[Task] | Iterable[tuple], stats: _Stats,
                    pool: CompressPool) -> AsyncIterator[bytes]:
    """Run `fn(view)` for each task on the pool, up to `pool.window` ahead of the
    consumer and each holding one of the pool's global slots; yield results in order.
    A task's `after` runs once its coder has read the view (a chunked sample's slot goes
    back); one that is never run gets it at once."""
    loop = asyncio.get_running_loop()
    running: list[asyncio.Future] = []
    exhausted = False

    def release(_fut: asyncio.Future) -> None:
        pool.slots.release()

    if not hasattr(tasks, "__aiter__"):
        tasks = _listed(tasks)
    async with contextlib.aclosing(aiter(tasks)) as source:
        try:
            while not exhausted or running:
                while not exhausted and len(running) < pool.window:
                    if running and pool.slots.locked():
                        break  # the global bound is reached: send what is done first
                    task = await anext(source, None)
                    if task is None:
                        exhausted = True
                        break
                    view, fn, *rest = task  # (view, coder) or (view, coder, after)
                    after = rest[0] if rest else None
                    try:
                        await pool.slots.acquire()
                    except BaseException:
                        if after is not None:
                            after()
                        raise
                    fut = loop.run_in_executor(pool.executor, timed(stats, fn), view)
                    fut.add_done_callback(release)
                    if after is not None:
                        fut.add_done_callback(lambda _f, after=after: after())
                    running.append(fut)
                    stats.raw += len(view)
                if not running:
                    continue
                out = await asyncio.shield(running[0])
                running.pop(0)
                stats.wire += len(out)
                yield out
            stats.complete = True
        finally:
            for fut in running:  # they read the arena: wait for them before it is reused
                if not fut.done():
                    try:
                        await asyncio.shield(fut)
                    except Exception:
                        pass


def _pieces(view: memoryview, size: int) -> list[memoryview]:
    return [view[i : i + size] for i in range(0, len(view), size)] or [view]


def _zstd_frame(level: int, data: memoryview) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def stream_bf16split(specs: list[TensorSpec], metadata: dict[str, str], parts: list, stats: _Stats,
                     pool: CompressPool) -> AsyncIterator[bytes]:
    """The bf16split body of tensors `specs` (bytes `parts`, `hidden_states` first and BF16):
    its header (metadata saying the layout) and the small tensors as zstd frames, the
    states as exponent-plane pieces (hsx/bf16split.py)."""
    meta = {**metadata, "encoding": bf16split.ENCODING, "bf16split_piece": str(PIECE)}
    header = memoryview(encode_header(specs, meta))
    small = functools.partial(_zstd_frame, pool.level)

    async def tasks() -> AsyncIterator[Task]:
        yield header, small, None
        for spec, part in zip(specs, parts):
            if hasattr(part, "pieces"):  # a chunked sample's states (body/response.StreamedPart)
                async with contextlib.aclosing(_regrouped(part, PIECE)) as regrouped:
                    async for view, after in regrouped:
                        yield view, bf16split.encode_piece, after
                continue
            view = memoryview(part).cast("B")
            coder = bf16split.encode_piece if spec.name == "hidden_states" else small
            for p in _pieces(view, PIECE):
                yield p, coder, None

    return _in_order(tasks(), stats, pool)


async def _regrouped(part, size: int) -> AsyncIterator[tuple[memoryview, "Callable[[], None] | None"]]:
    """A streamed part's bytes in pieces of exactly `size` (the last shorter), as bf16split's
    layout wants whatever the chunks: whole pieces are views of the chunk (its `done` on the
    last), a piece across two chunks is a copy (the chunk is given back once copied)."""
    carry = bytearray()
    async with contextlib.aclosing(part.pieces()) as pieces:
        async for piece, done in pieces:
            owed = True  # `done` is still this generator's to run
            try:
                view = memoryview(piece).cast("B")
                if carry:
                    take = min(size - len(carry), len(view))
                    carry += view[:take]
                    view = view[take:]
                    if len(carry) == size:
                        yield memoryview(bytes(carry)), None
                        carry = bytearray()
                whole = len(view) // size * size
                carry += view[whole:]
                if not whole:
                    owed = False
                    done()
                    continue
                for i in range(0, whole, size):
                    last = i + size == whole
                    owed = not last
                    yield view[i : i + size], done if last else None
            except BaseException:
                if owed:  # closed before the view carrying `done` went out: nothing reads the chunk
                    done()
                raise
    if carry:
        yield memoryview(bytes(carry)), None

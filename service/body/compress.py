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
import functools
from collections.abc import AsyncIterator, Callable
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


async def _in_order(tasks: list[tuple[memoryview, Callable[[memoryview], bytes]]], stats: _Stats,
                    pool: CompressPool) -> AsyncIterator[bytes]:
    """Run `fn(view)` for each task on the pool, up to `pool.window` ahead of the
    consumer and each holding one of the pool's global slots; yield results in order."""
    loop = asyncio.get_running_loop()
    running: list[asyncio.Future] = []
    nxt = 0

    def release(_fut: asyncio.Future) -> None:
        pool.slots.release()

    try:
        while nxt < len(tasks) or running:
            while nxt < len(tasks) and len(running) < pool.window:
                if running and pool.slots.locked():
                    break  # the global bound is reached: send what is done first
                await pool.slots.acquire()
                view, fn = tasks[nxt]
                fut = loop.run_in_executor(pool.executor, timed(stats, fn), view)
                fut.add_done_callback(release)
                running.append(fut)
                stats.raw += len(view)
                nxt += 1
            out = await running[0]
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
    tasks: list[tuple[memoryview, Callable[[memoryview], bytes]]] = [(header, small)]
    for spec, part in zip(specs, parts):
        view = memoryview(part).cast("B")
        if spec.name == "hidden_states":
            tasks += [(p, bf16split.encode_piece) for p in _pieces(view, PIECE)]
        else:
            tasks += [(p, small) for p in _pieces(view, PIECE)]
    return _in_order(tasks, stats, pool)

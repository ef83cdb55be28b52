"""Zstd bodies decoded while they arrive (client/zstd_stream.py): one frame, several
frames (also ending exactly on a chunk boundary), truncated, not zstd, empty, aborted."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zstandard

from hsx_client.zstd_stream import ZstdBodyDecoder

DATA = bytes(range(256)) * 4096 + b"tail"
C = zstandard.ZstdCompressor(level=1)


async def decode(body: bytes, step: int) -> bytes:
    d = ZstdBodyDecoder()
    for i in range(0, len(body), step):
        d.feed(body[i : i + step])
        await asyncio.sleep(0)  # the decoder works while "more arrives"
    d.finish()
    return await d.body()


@pytest.mark.parametrize("step", [1 << 10, 1 << 16, 1 << 30])
async def test_one_frame_in_any_chunking(step):
    assert await decode(C.compress(DATA), step) == DATA


async def test_several_frames_also_ending_on_a_chunk_boundary():
    first, second = C.compress(DATA[:5000]), C.compress(DATA[5000:])
    assert await decode(first + second, 4096) == DATA
    assert await decode(first + second, len(first)) == DATA  # a frame ends exactly where a chunk does


@pytest.mark.parametrize("body, why", [
    (C.compress(DATA)[:-7], "truncated"),
    (b"not zstd at all, but long enough to be read as a frame header", "Unknown frame descriptor"),
    (b"", "empty"),
])
async def test_bad_bodies_are_errors(body, why):
    with pytest.raises(zstandard.ZstdError, match=why):
        await decode(body, 1 << 12)


async def test_abort_ends_the_thread_without_a_result():
    before = threading.active_count()
    d = ZstdBodyDecoder()
    d.feed(C.compress(DATA)[:1000])
    d.abort()
    with pytest.raises(asyncio.CancelledError):
        await d.body()
    for _ in range(100):
        if threading.active_count() <= before:
            break
        await asyncio.sleep(0.01)
    assert threading.active_count() <= before


async def test_buffer_waits_until_the_input_justifies_the_declared_size(monkeypatch):
    """A header declaring far more than the body could hold allocates nothing of that
    size (a 1 TiB claim in a few KB); very compressible bodies still decode."""
    zeros = bytes(32 << 20)
    assert await decode(C.compress(zeros), 1 << 16) == zeros  # 32 MiB from ~1 KB: pieces, then frame by frame
    real = zstandard.frame_content_size
    monkeypatch.setattr(zstandard, "frame_content_size", lambda _: 1 << 40)
    assert await decode(C.compress(DATA), 1 << 12) == DATA
    monkeypatch.setattr(zstandard, "frame_content_size", real)


async def test_a_declared_frame_is_decoded_into_one_buffer():
    out = await decode(C.compress(DATA), 1 << 12)
    assert isinstance(out, bytearray) and out == DATA  # the fast way: no join


@pytest.mark.parametrize("frame_threads", [0, 2])
async def test_the_servers_frame_single_or_multithreaded_decodes_as_it_arrives(frame_threads):
    """hsx serve's zstd body (response.stream_zstd, --zstd-frame-threads): one frame that
    declares its size, whatever the threads, decoded the fast way."""
    from hsx_service.body.compress import CompressPool
    from hsx_service.body.response import Body, Stats, stream_zstd

    import numpy as np

    noise = np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32).view(np.uint32) >> 16
    data = noise.astype(np.uint16).tobytes() * 2  # 12 MiB of bf16-like bits: three 4 MiB steps, ~1.2x
    pool = CompressPool(2, 8, 1, frame_threads=frame_threads)
    try:
        chunks = [bytes(c) async for c in stream_zstd(Body([data]), Stats(), 1, pool.executor, pool.frame_threads)]
    finally:
        pool.shutdown()
    whole = b"".join(chunks)
    assert zstandard.frame_content_size(whole) == len(data)
    d = ZstdBodyDecoder()
    for c in chunks:
        d.feed(c)
    d.finish()
    out = await d.body()
    assert isinstance(out, bytearray) and out == data


def test_frame_threads_default_follows_the_core_count():
    """--zstd-frame-threads unset: 2 zstd threads per body on hosts with >= 8 cores (measured
    on the 16-core H200 host), none on small ones (on the 2-core box they cost more)."""
    from hsx_service.body.compress import CompressPool, default_frame_threads
    from hsx_service.settings import ServiceSettings

    assert [default_frame_threads(c) for c in (1, 2, 4, 7, 8, 16, 128)] == [0, 0, 0, 0, 2, 2, 2]
    assert ServiceSettings.model_fields["zstd_frame_threads"].default is None
    pool = CompressPool(1, 1, 1, frame_threads=None)
    try:
        assert pool.frame_threads == default_frame_threads()
    finally:
        pool.shutdown()
    pool = CompressPool(1, 1, 1, frame_threads=0)  # given: kept, 0 included
    try:
        assert pool.frame_threads == 0
    finally:
        pool.shutdown()

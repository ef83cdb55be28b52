"""The client's one incremental zstd decoder (client/zstd_stream.py): one frame in any
chunking, several frames (also ending exactly on a chunk boundary), and truncated, not-zstd
and empty bodies as StreamErrors (malformed bodies)."""

from __future__ import annotations

import pytest
import zstandard

from hsx_client.sample_stream import StreamError
from hsx_client.zstd_stream import ZstdFrames

DATA = bytes(range(256)) * 4096 + b"tail"
C = zstandard.ZstdCompressor(level=1)


def decode(body: bytes, step: int) -> bytes:
    d = ZstdFrames()
    out = b"".join(p for i in range(0, len(body), step) for p in d.decode(body[i : i + step]))
    d.finish()
    return out


@pytest.mark.parametrize("step", [1 << 10, 1 << 16, 1 << 30])
def test_one_frame_in_any_chunking(step):
    assert decode(C.compress(DATA), step) == DATA


def test_several_frames_also_ending_on_a_chunk_boundary():
    first, second = C.compress(DATA[:5000]), C.compress(DATA[5000:])
    assert decode(first + second, 4096) == DATA
    assert decode(first + second, len(first)) == DATA  # a frame ends exactly where a chunk does


@pytest.mark.parametrize("body, why", [
    (C.compress(DATA)[:-7], "truncated"),
    (b"not zstd at all, but long enough to be read as a frame header", "Unknown frame descriptor"),
    (b"", "empty"),
])
def test_bad_bodies_are_errors(body, why):
    with pytest.raises(StreamError, match=why):
        decode(body, 1 << 12)

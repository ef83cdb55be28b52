"""The one incremental zstd decoder of the client: a zstd-coded body decoded piece by piece
as it arrives (zstandard's own `decompressobj`), whether the reader keeps the whole body
(`SampleStream.collect`) or hands the states on in chunks.

Concatenated frames are decoded one after another (RFC 8878: a body may hold several);
a body that ends inside a frame is an error, as is an empty one or one that is not zstd at
all. Every such error is a `StreamError` (hsx.wire's WireFormatError: a malformed body).
"""

from __future__ import annotations

from collections.abc import Iterator

import zstandard

from hsx_client.sample_stream import StreamError

# Decoder output steps: the default 128 KiB ones cost ~2x in joins of a whole body.
WRITE_SIZE = 4 << 20


class ZstdFrames:
    """`decode(data)` yields what `data` completes; `finish()` once the body is in says
    whether it ended between frames. Not thread-safe: one body, one thread at a time."""

    def __init__(self, write_size: int = WRITE_SIZE) -> None:
        self._d = zstandard.ZstdDecompressor()
        self._write_size = write_size
        self._frame: zstandard.ZstdDecompressionObj | None = None  # None between frames
        self._seen = False

    def decode(self, data: bytes | bytearray | memoryview) -> Iterator[bytes]:
        while data:
            self._seen = True
            if self._frame is None:
                self._frame = self._d.decompressobj(write_size=self._write_size)
            try:
                piece = self._frame.decompress(data)
            except zstandard.ZstdError as exc:
                raise StreamError(f"not a zstd body: {exc}") from exc
            if piece:
                yield piece
            if self._frame.eof:  # the next frame, if any, starts in what this one left
                data, self._frame = self._frame.unused_data, None
            else:
                data = b""

    def finish(self) -> None:
        if not self._seen:
            raise StreamError("an empty body labelled zstd")
        if self._frame is not None:
            raise StreamError("the zstd body ends inside a frame (truncated)")

"""Decoding a zstd-coded response body while it arrives.

A compressed body trickles in at the pace the server compresses it (a 67 MB body of the
Llama-8B shape took ~0.34 s to arrive on the H200 host, 2026-12-02), and decoding it
after the last byte added its whole decode time (~0.13 s) to every request, and to the
run's tail. Here each body gets a thread of its own (zstandard releases the GIL) that
decodes the chunks as the event loop hands them over, so only the last chunk's decode
remains after the last byte. A thread per body rather than a pool: a decoder
waits for its input, and must not hold a pool thread other work (storing) queues for.

Concatenated frames are decoded one after another (RFC 8878: a body may hold several);
a body that ends inside a frame is an error, as is one that is not zstd at all.
"""

from __future__ import annotations

import asyncio
import queue
import threading

import zstandard

WRITE_SIZE = 4 << 20  # decoder output steps (the default 128 KiB ones cost ~2x in joins)
_END = object()
_ABORT = object()


class ZstdBodyDecoder:
    """`feed` each chunk as it arrives, then `finish` and await `body()`; `abort`
    (any time, however the receive ended) stops the thread without a result."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._result: asyncio.Future[bytes] = self._loop.create_future()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.received = 0
        threading.Thread(target=self._run, name="hsx-zstd-decode", daemon=True).start()

    def feed(self, chunk: bytes) -> None:
        if chunk:
            self.received += len(chunk)
            self._queue.put(chunk)

    def finish(self) -> None:
        self._queue.put(_END)

    def abort(self) -> None:
        self._queue.put(_ABORT)
        if not self._result.done():
            self._result.cancel()

    async def body(self) -> bytes:
        return await self._result

    def _run(self) -> None:
        try:
            body = self._decode()
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting request
            self._loop.call_soon_threadsafe(self._settle, None, exc)
        else:
            if body is not None:
                self._loop.call_soon_threadsafe(self._settle, body, None)

    def _settle(self, body: bytes | None, exc: Exception | None) -> None:
        if self._result.done():  # aborted meanwhile
            return
        if exc is not None:
            self._result.set_exception(exc)
        else:
            self._result.set_result(body)

    def _decode(self) -> bytes | bytearray | None:
        """The fast way (a frame that declares its size, as hsx serve sends): decoded
        straight into one buffer of that size. Anything else (no declared size, several
        frames, a short or broken body): the received chunks again, frame by frame, which
        says what is wrong."""
        d = zstandard.ZstdDecompressor()
        chunks: list[bytes] = []
        consumed = 0  # input bytes taken from the queue (this thread's count, not feed's)
        header_read = False
        sink: _Sink | None = None  # set when the header declares a size: the fast way
        writer = None
        while True:
            item = self._queue.get()
            if item is _ABORT:
                return None
            if item is _END:
                break
            chunks.append(item)
            consumed += len(item)
            if not header_read and consumed >= FRAME_HEADER_MAX:
                header_read = True
                head = chunks[0] if len(chunks[0]) >= FRAME_HEADER_MAX else b"".join(chunks)[:FRAME_HEADER_MAX]
                try:
                    declared = zstandard.frame_content_size(head)
                except zstandard.ZstdError:
                    declared = -1  # not a frame header: the careful way below says so
                if declared > 0:
                    sink = _Sink(declared)
                    writer = d.stream_writer(sink, write_size=WRITE_SIZE, closefd=False)
                    so_far = 0
                    for c in chunks:
                        so_far += len(c)
                        sink.allow(so_far)
                        writer.write(c)
            elif sink is not None:
                sink.allow(consumed)
                writer.write(item)
        if sink is not None and sink.complete:
            return sink.buffer
        return _frame_by_frame(d, chunks, consumed)


FRAME_HEADER_MAX = 18  # bytes: the longest zstd frame header (RFC 8878 section 3.1.1.1)
# A frame may declare at most this many times the input received so far as its content
# before its buffer is allocated: bf16 states compress ~1.3x, so more is a broken or
# hostile header, not a body worth allocating for (output waits in pieces meanwhile).
MAX_DECLARED_RATIO = 16


class _Sink:
    """Where the fast way writes: pieces until the input received justifies the declared
    size, then one buffer of that size (the pieces copied in). More output than declared
    (several frames) or less (truncated): not `complete`, and the careful way decides."""

    def __init__(self, declared: int) -> None:
        self.declared = declared
        self.buffer: bytearray | None = None
        self.pieces: list[bytes] = []
        self.n = 0
        self.overflow = False

    def allow(self, received: int) -> None:
        if self.buffer is None and 0 < self.declared <= MAX_DECLARED_RATIO * received + (1 << 20):
            self.buffer = bytearray(self.declared)
            pos = 0
            for p in self.pieces:
                self.buffer[pos : pos + len(p)] = p
                pos += len(p)
            self.pieces = []

    def write(self, data) -> int:
        n = len(data)
        if self.n + n > self.declared:
            self.overflow = True  # several frames: the careful way decodes them all
        elif self.buffer is not None:
            self.buffer[self.n : self.n + n] = data
        else:
            self.pieces.append(bytes(data))
        self.n += n
        return n

    @property
    def complete(self) -> bool:
        return not self.overflow and self.n == self.declared and self.buffer is not None


def _frame_by_frame(d: zstandard.ZstdDecompressor, chunks: list[bytes], received: int) -> bytes:
    frame = None  # the frame being decoded; None between frames
    out: list[bytes] = []
    for data in chunks:
        while data:
            if frame is None:
                frame = d.decompressobj(write_size=WRITE_SIZE)
            piece = frame.decompress(data)
            if piece:
                out.append(piece)
            if frame.eof:  # the next frame, if any, starts in what this one left
                data, frame = frame.unused_data, None
            else:
                data = b""
    if frame is not None:
        raise zstandard.ZstdError("the zstd body ends inside a frame (truncated)")
    if not out and received == 0:
        raise zstandard.ZstdError("an empty body labelled zstd")
    return out[0] if len(out) == 1 else b"".join(out)

"""A `POST /hidden_states` answer read as it arrives over HTTP: identity or zstd bodies
(the one decoder, hsx_client.zstd_stream), the states in chunks of whole tokens
(hsx_client.body_parser), the head once they are through; or, `collect()`ed, the whole body."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Awaitable
from typing import Any

from hsx import wire
from hsx_client.body_parser import BodyParser
from hsx_client.errors import HsxError
from hsx_client.responses import RawResponse
from hsx_client.sample_stream import (
    DEFAULT_CHUNK_BYTES, ZSTD_BATCH, SampleHead, StatesChunk, StatesLayout, StreamError, malformed_body,
)
from hsx_client.zstd_stream import ZstdFrames

class HttpSampleStream:
    """`response`: the httpx response, open (status 200 checked); `closer`: closes it (the
    `http.stream(...)` context). Transport errors mid-body are the client's HsxErrors
    (`wrap_transport`), a body that is not one sample a ResponseValidationError; `account`
    gets (wire bytes, body bytes, seconds receiving, seconds decoding after the last byte)
    once the body is through."""

    def __init__(self, response: Any, closer: Callable[[], Awaitable[Any]], *, encoding: str,
                 wrap_transport: Callable[[Exception], HsxError], chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 request_id: str | None = None, server: str = "",
                 account: Callable[[int, int, float, float], None] | None = None) -> None:
        self._resp = response
        self._closer = closer
        self._wrap_transport = wrap_transport
        self._account = account
        self._t0 = time.perf_counter()
        self._t_last_byte: float | None = None
        self._parser = BodyParser(chunk_bytes)
        if response.is_stream_consumed:  # a transport that hands back read (decoded) responses: tests' fakes
            self._zstd, self._raw_iter = None, _one(response.content)
        else:
            self._zstd = ZstdFrames() if encoding == "zstd" else None
            self._raw_iter = response.aiter_raw().__aiter__()
        self._head: SampleHead | None = None
        self._closed = False
        self._started = False
        self._pending: list = []
        self._ended = False  # the zstd body's last byte is in
        self.request_id = request_id
        self.server = server
        self.wire_bytes = 0
        self.receive_s = 0.0  # headers in -> last byte in, once the body is through
        self.lease = None
        self.taken_bytes = 0

    async def _next_raw(self) -> bytes | None:
        try:
            raw = await self._raw_iter.__anext__()
        except StopAsyncIteration:
            self._t_last_byte = time.perf_counter()
            return None
        except HsxError:
            raise
        except Exception as exc:
            raise self._wrap_transport(exc) from exc
        self.wire_bytes += len(raw)
        return raw

    async def _next_pieces(self) -> list[bytes] | None:
        """The next decoded pieces of the body; None at its end. zstd input is gathered to
        ZSTD_BATCH and decoded in a thread (zstandard releases the GIL): the event loop keeps
        receiving the other streams meanwhile."""
        if self._zstd is None:
            raw = await self._next_raw()
            return None if raw is None else [raw]
        if self._ended:
            return None
        batch, n = [], 0
        while n < ZSTD_BATCH:
            raw = await self._next_raw()
            if raw is None:
                self._ended = True
                break
            batch.append(raw)
            n += len(raw)
        zstd = self._zstd

        def decode() -> list[bytes]:
            out = [p for raw in batch for p in zstd.decode(raw)]
            if self._ended:
                zstd.finish()
            return out

        pieces = await asyncio.to_thread(decode)
        return pieces if pieces or not self._ended else None

    async def layout(self) -> StatesLayout:
        """Reads the body up to its header's end; what came after waits in `_pending`."""
        with malformed_body(self.server, self.request_id):
            while self._parser.layout is None:
                pieces = await self._next_pieces()
                if pieces is None:
                    raise StreamError("body ended inside its header (truncated?)")
                for p in pieces:
                    if self._parser.layout is not None:
                        self._pending.append(p)
                        continue
                    rest = self._parser.feed_header(memoryview(p).cast("B"))
                    if rest.nbytes:
                        self._pending.append(rest)
        return self._parser.layout

    def _start(self) -> None:
        if self._started:
            raise RuntimeError("a sample stream's body can be read once")
        self._started = True

    async def chunks(self) -> AsyncIterator[StatesChunk]:
        self._start()
        await self.layout()
        pieces: list | None = self._pending
        self._pending = []
        with malformed_body(self.server, self.request_id):
            while pieces is not None:
                for p in pieces:
                    for c in self._parser.feed(p):
                        yield c
                pieces = await self._next_pieces()
            self._head = self._parser.finish()
        self._body_through(self._parser.body_bytes)

    def _body_through(self, body_bytes: int) -> None:
        now = time.perf_counter()
        last_byte = self._t_last_byte or now
        self.receive_s = last_byte - self._t0
        if self._account is not None:
            self._account(self.wire_bytes, body_bytes, self.receive_s, now - last_byte)

    async def head(self) -> SampleHead:
        if self._head is None:
            if self._started:
                raise RuntimeError("head() before the chunks were read to their end")
            async for _ in self.chunks():  # states nobody asked for: read past them
                pass
        assert self._head is not None
        return self._head

    async def collect(self) -> RawResponse:
        """The whole body, checked (its layout, not its tensors), the response closed."""
        self._start()
        try:
            with malformed_body(self.server, self.request_id):
                pieces: list[bytes] = []
                while (more := await self._next_pieces()) is not None:
                    pieces.extend(more)
                body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                wire.check_body(body)
        finally:
            await self.aclose()
        self._body_through(len(body))
        return RawResponse(body=body, request_id=self.request_id, server=self.server, wire_bytes=self.wire_bytes)

    async def take_out(self) -> None:
        """Nothing to take out: an HTTP body holds no lease."""

    async def release(self) -> None:
        """Nothing to release: an HTTP body holds no lease."""

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._closer()


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data

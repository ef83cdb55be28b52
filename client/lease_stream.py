"""The chunked lease form (hsx/wire.py LEASE_STREAM_MEDIA_TYPE) as a SampleStream.

A same-host server answers a lease request whose states exceed its stream window with the
lease head (token ids, mask, metadata, the states' dtype and shape) and then one lease per
chunk as it lands in the arena. Each chunk is copied out of this client's read-only mapping
of the arena into one reused buffer as soon as its record is read, and its lease released
then (strictly: a 410 means the bytes may have been overwritten, LeaseExpiredError), before
the caller writes it: a lease held through a write (and a file's fsync) on a loaded box
expired, and an expired chunk lease ends the request on the server. The first chunk is taken
out with the head, before the caller opens its file. The stream's memory is one chunk.

torch is imported with this module, which HsxClient loads in a thread when it attaches to an
arena: imported lazily in `head()`, it ran on the event loop while the first chunk leases'
clocks ran, and on a loaded box (seconds to minutes for a first `import torch`) they expired.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import torch

from hsx import dtypes, wire
from hsx_client.errors import HsxError, LeaseExpiredError, ServerError
from hsx_client.responses import THREAD_COPY_BYTES, Lease, RawResponse, copy_into
from hsx_client.sample_stream import SampleHead, StatesChunk, StatesLayout, malformed_body


class LeaseStream:
    """One sample's states under chunk leases (satisfies hsx_client.sample_stream.SampleStream).

    `response`: the open streamed response whose headers said LEASE_STREAM_MEDIA_TYPE;
    `close_response`: closes it (closing it early tells the server to stop)."""

    def __init__(self, client: Any, server: str, response: Any, close_response: Callable[[], Awaitable[Any]],
                 arena: Any, request_id: str | None) -> None:
        self._client = client
        self._server = server
        self._response = response
        self._close_response = close_response
        self._arena = arena
        self.request_id = request_id
        self.server = server
        self.lease = None  # no whole lease: each chunk's is released as the next is asked for
        self.wire_bytes = 0
        self.receive_s = 0.0  # the records are small: receiving is not what a lease costs
        self.taken_bytes = 0  # one chunk at a time, in the stream's own buffer
        self._raw = response.aiter_raw()
        self._reader = wire.LeaseStreamReader()
        self._records: deque[dict] = deque()
        self._out: Lease | None = None  # the lease of the chunk handed out last
        self._head: Any = None
        self._next_token = 0
        self._closed = False
        self._buf: bytearray | None = None  # the chunk taken out last (reused)
        self._taken: StatesChunk | None = None  # taken out with the head, not yet handed out
        self._ended = False

    async def _read_more(self) -> None:
        try:
            data = await self._raw.__anext__()
        except StopAsyncIteration:
            self._reader.finish()  # raises: the body ended without its end record
            raise wire.WireFormatError("lease stream ended early") from None
        self.wire_bytes += len(data)
        self._records.extend(self._reader.feed(data))

    async def layout(self) -> StatesLayout:
        head = await self.head()
        return StatesLayout(head.dtype, head.shape, head.metadata)

    async def head(self) -> SampleHead:
        if self._head is None:
            with malformed_body(self._server, self.request_id):
                self._head = await self._read_head()
                self._taken = await self._take_next()  # before the caller does anything slow
        return self._head

    async def _read_head(self) -> SampleHead:
        while self._reader.head is None:
            await self._read_more()
        lease = self._reader.lease
        if lease["arena_id"] != self._arena.arena_id:
            raise wire.WireFormatError("the lease names another arena (server restarted?)")
        header, start = wire.check_body(self._reader.head)
        view = memoryview(self._reader.head)
        arrays = {}
        for name, e in header.items():
            if name != "__metadata__":
                lo, hi = e["data_offsets"]
                arrays[name] = np.frombuffer(view[start + lo : start + hi], dtype=np.dtype(dtypes.BY_ST[e["dtype"]].name))
        if "token_ids" not in arrays:
            raise wire.WireFormatError("lease stream head lacks token_ids")
        meta = {k: v for k, v in header.get("__metadata__", {}).items() if k != "lease"}
        shape = tuple(int(d) for d in lease["shape"])
        if len(shape) != 3 or shape[0] != len(arrays["token_ids"]):
            raise wire.WireFormatError(f"hidden_states {shape} does not match {len(arrays['token_ids'])} tokens")
        return SampleHead(arrays["token_ids"], arrays.get("loss_mask"), meta,
                          getattr(torch, dtypes.BY_ST[lease["dtype"]].name), shape, arrays.get("media_mask"))

    async def take_out(self) -> None:
        """The head and the first chunk taken out of the arena (the others are, as they are read)."""
        await self.head()

    async def _release_out(self, strict: bool = True) -> None:
        lease, self._out = self._out, None
        if lease is None:
            return
        try:
            await self._client.release_lease(lease)
        except HsxError:
            if strict:
                raise

    async def _take_next(self) -> StatesChunk | None:
        """The next chunk copied out of the arena, its lease released (LeaseExpiredError when
        it had expired: the copy may be stale); None after the last."""
        if self._ended:
            return None
        head = self._head
        total, n_layers, hidden = head.shape
        row = n_layers * hidden * dtypes.BY_ST[self._reader.lease["dtype"]].itemsize
        while not self._records:
            await self._read_more()
        rec = self._records.popleft()
        if "error" in rec:
            status = rec.get("status", 502)
            if status == 410:  # the server ended the request: a chunk lease expired before its release
                self._client.note_lease_expired(self._server)
                raise LeaseExpiredError(f"the server ended the sample: {rec['error']}", status=410, type="lease_gone",
                                        request_id=self.request_id, server=self._server)
            raise ServerError(f"the server failed mid-sample: {rec['error']}", status=status,
                              type="engine_error", request_id=self.request_id, server=self._server)
        if "end" in rec:
            self._ended = True
            if self._next_token != total:
                raise wire.WireFormatError(f"lease stream ended at token {self._next_token} of {total}")
            return None
        a, b = (int(t) for t in rec["tokens"])
        self._out = Lease(rec["id"], self._server, memoryview(b""))
        nbytes = int(rec["nbytes"])
        if a != self._next_token or not a < b <= total or nbytes != (b - a) * row:
            raise wire.WireFormatError(f"lease stream chunk {rec} out of order or mis-sized")
        if self._buf is None or len(self._buf) < nbytes:
            self._buf = bytearray(nbytes)
        data = memoryview(self._buf)[:nbytes]
        view = self._arena.view(int(rec["offset"]), nbytes)
        if nbytes >= THREAD_COPY_BYTES:
            await asyncio.to_thread(copy_into, data, view)
        else:
            copy_into(data, view)
        await self._release_out()  # its slot may take a later chunk; a 410: the copy may be stale
        self._next_token = b
        return StatesChunk(a, b, data)

    async def chunks(self) -> AsyncIterator[StatesChunk]:
        await self.head()
        while True:
            chunk, self._taken = self._taken, None
            if chunk is None:
                with malformed_body(self._server, self.request_id):
                    chunk = await self._take_next()
            if chunk is None:
                return
            yield chunk  # a copy, valid until the next chunk is asked for

    async def release(self) -> None:
        """Nothing is held once `chunks()` has ended (each lease was released on the way)."""
        await self._release_out()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._release_out(strict=False)
        await self._close_response()

    async def collect(self) -> RawResponse:
        """The whole sample as one body (for callers of whole responses): holds it in memory."""
        try:
            head = await self.head()
            states = bytearray()
            async for chunk in self.chunks():
                states += chunk.data
        finally:
            await self.aclose()
        header, start = wire.check_body(self._reader.head)
        tensors = sorted((e["data_offsets"][0], name, e) for name, e in header.items() if name != "__metadata__")
        specs = [wire.TensorSpec("hidden_states", self._reader.lease["dtype"], head.shape)]
        parts: list = [bytes(states)]
        for lo, name, e in tensors:
            specs.append(wire.TensorSpec(name, e["dtype"], tuple(e["shape"])))
            parts.append(self._reader.head[start + lo : start + e["data_offsets"][1]])
        body = wire.encode_header(specs, {k: str(v) for k, v in head.metadata.items()}) + b"".join(parts)
        return RawResponse(body=body, request_id=self.request_id, server=self._server, wire_bytes=self.wire_bytes)

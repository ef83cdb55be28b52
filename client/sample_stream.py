"""One sample's states as a stream of token chunks (issue 29): the interface between the
transports (HTTP body, whole lease, chunked lease) and the writers (corpus files, the
online trainer), so that no side ever holds a whole sample.

    stream = await client.hidden_states_stream(body, lease_ok=True)
    try:
        layout = await states_layout(stream)       # dtype and [T, L, H]: before any state
        async for c in stream.chunks():            # tokens [c.start, c.stop), in order
            write(c.data)                          # valid until the next chunk is asked for
        head = await stream.head()                 # token ids, loss mask, metadata
    finally:
        await stream.aclose()

Over HTTP the body is the one safetensors file of hsx/wire.py (hidden_states first, token-
major, then token_ids and loss_mask), so the ids arrive last: `head()` of an HTTP stream
is known only once its chunks are consumed, and `layout()` (from the header) is what a
writer needs first. A lease stream knows its head at once; `states_layout` serves both.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hsx import dtypes, wire

# Bytes of states a stream hands over at once (whole tokens; at least one token): big
# enough that a write or an await per chunk costs little, small beside any memory budget.
DEFAULT_CHUNK_BYTES = 4 << 20
# zstd input decoded at once, in a thread (its output: ~1.3x that, bf16 states).
ZSTD_BATCH = 512 << 10


@dataclass(frozen=True)
class SampleHead:
    token_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray | None  # uint8 [T]
    metadata: dict[str, str]
    dtype: Any  # torch.dtype of hidden_states
    shape: tuple[int, int, int]  # [T, L, H]
    media_mask: np.ndarray | None = None  # uint8 [T]: 1 on each image token (chats with images)

    @property
    def layer_ids(self) -> list[int]:
        return json.loads(self.metadata["layer_ids"])

    @property
    def hidden_states(self) -> Any:
        """Stands in for `wire.Decoded.hidden_states` in checks of shape and dtype only."""
        return _ShapeOnly(self.shape, self.dtype)


@dataclass(frozen=True)
class StatesLayout:
    """What the header says before the first state: enough to lay out a file."""

    dtype: Any  # torch.dtype
    shape: tuple[int, int, int]
    metadata: dict[str, str]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's states (L * H * itemsize)."""
        _, n_layers, hidden = self.shape
        return n_layers * hidden * _itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


@dataclass(frozen=True)
class StatesChunk:
    start: int  # first token
    stop: int  # one past the last token
    data: memoryview  # (stop - start) * L * H * itemsize bytes; valid only until the next chunk is asked for


class SampleStream(Protocol):
    async def head(self) -> SampleHead: ...

    def chunks(self) -> AsyncIterator[StatesChunk]: ...

    async def aclose(self) -> None: ...


async def states_layout(stream: Any) -> StatesLayout:
    """The layout before any chunk: a stream's own `layout()` when it has one (HTTP: from
    the body's header), else from its head (a lease stream knows it at once)."""
    layout = getattr(stream, "layout", None)
    if layout is not None:
        return await layout()
    head = await stream.head()
    return StatesLayout(head.dtype, tuple(head.shape), head.metadata)


class StreamError(wire.WireFormatError):
    """A body that does not parse as a stream of one sample (truncated, malformed)."""


@dataclass(frozen=True)
class _ShapeOnly:
    shape: tuple[int, int, int]
    dtype: Any

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _itemsize(torch_dtype: Any) -> int:
    return dtypes.by_name(str(torch_dtype).removeprefix("torch.")).itemsize


def _torch_dtype(st_code: str) -> Any:
    import torch

    dt = dtypes.BY_ST.get(st_code)
    if dt is None:
        raise StreamError(f"hidden_states has unsupported dtype {st_code!r}")
    return getattr(torch, dt.name)


# ----------------------------------------------------------------------------- the parser
class BodyParser:
    """The wire body (hsx/wire.py's safetensors file) parsed as its bytes arrive, in pieces
    cut anywhere: `feed(data)` yields the states in chunks of whole tokens (at most
    `chunk_bytes`, at least one token), copied once into one reused buffer; `finish()`
    checks that the body ended where its header says and returns the head.

    Memory: the header, one chunk buffer and the tail (token ids and mask, 9 bytes a token)."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self.layout: StatesLayout | None = None
        self._prefix = bytearray()  # the header while it arrives
        self._header: dict[str, Any] | None = None
        self._states_total = 0
        self._states_seen = 0
        self._rows_done = 0
        self._buf: bytearray | None = None
        self._fill = 0
        self._tail = bytearray()  # token_ids and loss_mask
        self._tail_total = 0

    @property
    def body_bytes(self) -> int:
        return len(self._prefix) + self._states_seen + len(self._tail)

    @property
    def states_done(self) -> bool:
        return self._header is not None and self._states_seen == self._states_total

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[StatesChunk]:
        view = memoryview(data).cast("B")
        if self._header is None:
            view = self.feed_header(view)
            if self._header is None:
                return
        while view.nbytes and self._states_seen < self._states_total:
            assert self._buf is not None
            take = min(view.nbytes, len(self._buf) - self._fill, self._states_total - self._states_seen)
            self._buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            self._states_seen += take
            view = view[take:]
            if self._fill == len(self._buf) or self._states_seen == self._states_total:
                yield self._flush()
        if view.nbytes:
            if len(self._tail) + view.nbytes > self._tail_total:
                raise StreamError(f"body runs past the {self._states_total + self._tail_total} data bytes "
                                  "its header describes")
            self._tail += view

    def _flush(self) -> StatesChunk:
        assert self.layout is not None and self._buf is not None
        row = self.layout.row_bytes
        rows = self._fill // row
        chunk = StatesChunk(self._rows_done, self._rows_done + rows, memoryview(self._buf)[: self._fill])
        self._rows_done += rows
        self._fill = 0
        return chunk

    def feed_header(self, view: memoryview) -> memoryview:
        """Takes the header's bytes from `view`; returns what follows them."""
        if self._header is not None:
            return view
        need = 8 if len(self._prefix) < 8 else 8 + struct.unpack("<Q", self._prefix[:8])[0]
        while True:
            take = min(view.nbytes, need - len(self._prefix))
            self._prefix += view[:take]
            view = view[take:]
            if len(self._prefix) < need:
                return view
            if need == 8:
                (n,) = struct.unpack("<Q", self._prefix[:8])
                if n > 100 << 20:
                    raise StreamError(f"safetensors header of {n} bytes: not an hsx body")
                need = 8 + n
                continue
            self._start(bytes(self._prefix[8:]))
            return view

    def _start(self, raw_header: bytes) -> None:
        try:
            header = json.loads(raw_header)
        except ValueError as exc:
            raise StreamError(f"safetensors header is not JSON: {exc}") from exc
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        hs = entries.get("hidden_states")
        if hs is None or "token_ids" not in entries:
            raise StreamError("response lacks the hidden_states or token_ids tensor")
        if hs["data_offsets"][0] != 0 or any(v["data_offsets"][0] < hs["data_offsets"][1]
                                             for k, v in entries.items() if k != "hidden_states"):
            raise StreamError("hidden_states is not first in the body: it cannot be streamed")
        shape = tuple(int(d) for d in hs["shape"])
        if len(shape) != 3:
            raise StreamError(f"hidden_states has shape {shape}, not [T, L, H]")
        layout = StatesLayout(_torch_dtype(hs["dtype"]), shape, header.get("__metadata__", {}))
        total = hs["data_offsets"][1]
        if total != layout.nbytes:
            raise StreamError(f"hidden_states: {total} bytes for shape {shape}")
        end = max(v["data_offsets"][1] for v in entries.values())
        self._header, self.layout = header, layout
        self._states_total, self._tail_total = total, end - total
        rows = max(1, self.chunk_bytes // max(1, layout.row_bytes))
        self._buf = bytearray(min(total, rows * layout.row_bytes)) if total else bytearray()

    def finish(self) -> SampleHead:
        """The head, once the whole body went through `feed`; StreamError when it is short."""
        if self._header is None or not self.states_done or len(self._tail) != self._tail_total:
            got = len(self._prefix) + self._states_seen + len(self._tail)
            raise StreamError(f"body ended after {got} bytes, before its header's end (truncated?)")
        assert self.layout is not None
        tensors = {}
        for name in ("token_ids", "loss_mask", "media_mask"):
            e = self._header.get(name)
            if e is None:
                continue
            lo, hi = (o - self._states_total for o in e["data_offsets"])
            dt = dtypes.BY_ST.get(e["dtype"])
            if dt is None:
                raise StreamError(f"tensor {name!r} has unsupported dtype {e['dtype']!r}")
            arr = np.frombuffer(self._tail, dtype=np.dtype(dt.name if dt.name != "bfloat16" else "u2"),
                                count=(hi - lo) // dt.itemsize, offset=lo)
            tensors[name] = arr.reshape([int(d) for d in e["shape"]])
        ids, mask = tensors["token_ids"], tensors.get("loss_mask")
        t = self.layout.shape[0]
        if ids.shape != (t,) or (mask is not None and mask.shape != (t,)):
            raise StreamError(f"token_ids {ids.shape} / loss_mask do not match {t} tokens of states")
        media = tensors.get("media_mask")
        if media is not None and media.shape != (t,):
            raise StreamError(f"media_mask {media.shape} does not match {t} tokens of states")
        return SampleHead(ids, mask, self.layout.metadata, self.layout.dtype, self.layout.shape, media)


class ZstdPieces:
    """A zstd body decoded piece by piece as it arrives (several frames too, RFC 8878)."""

    def __init__(self, write_size: int = 1 << 20) -> None:
        import zstandard

        self._d = zstandard.ZstdDecompressor()
        self._write_size = write_size
        self._frame: Any = None
        self._seen = False

    def decode(self, data: bytes) -> Iterator[bytes]:
        while data:
            self._seen = True
            if self._frame is None:
                self._frame = self._d.decompressobj(write_size=self._write_size)
            piece = self._frame.decompress(data)
            if piece:
                yield piece
            if self._frame.eof:
                data, self._frame = self._frame.unused_data, None
            else:
                data = b""

    def finish(self) -> None:
        if self._frame is not None or not self._seen:
            raise StreamError("the zstd body ends inside a frame (truncated)" if self._seen
                              else "an empty body labelled zstd")


# ----------------------------------------------------------------------------- producers
class WholeSampleStream:
    """A sample already here whole (a lease view, a body read whole): one chunk, no copy.
    `take_out()` copies a lease's states here and releases it at once (LeaseExpiredError when
    it had expired): call it before anything slow. Otherwise `release` (a lease's strict
    release) is the caller's once the states are stored; `aclose` gives a lease back quietly."""

    def __init__(self, raw: Any, client: Any = None) -> None:
        self._raw = raw  # hsx_client.responses.RawResponse
        self._client = client
        self._decoded: wire.Decoded | None = None
        self.lease = raw.lease
        self.request_id = raw.request_id
        self.wire_bytes = raw.wire_bytes
        self.taken_bytes = 0  # the states taken out of a lease (in this process's memory)

    def _decode(self) -> wire.Decoded:
        if self._decoded is None:
            self._decoded = self._raw.decode()
        return self._decoded

    async def head(self) -> SampleHead:
        d = self._decode()
        hs = d.hidden_states
        return SampleHead(d.token_ids, d.loss_mask, d.metadata, hs.dtype, tuple(hs.shape), d.media_mask)

    async def chunks(self) -> AsyncIterator[StatesChunk]:
        hs = self._decode().hidden_states
        if hs.shape[0]:
            yield StatesChunk(0, int(hs.shape[0]), memoryview(hs.reshape(-1).view(dtype=_u8()).numpy()))

    async def take_out(self) -> None:
        if self.lease is not None and self._client is not None:
            self.lease = None  # released by take_out, whatever it answers
            self._raw = await self._client.take_out(self._raw)
            self._decoded = None
            self.taken_bytes = len(self._raw.states or b"")

    async def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None and self._client is not None:
            await self._client.release_lease(lease)

    async def aclose(self) -> None:
        from hsx_client.errors import HsxError

        self._decoded = None
        try:
            await self.release()
        except HsxError:
            pass


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _u8() -> Any:
    import torch

    return torch.uint8


class HttpSampleStream:
    """A `POST /hidden_states` answer read as it arrives: identity or zstd bodies, the
    states in chunks of whole tokens (BodyParser), the head once they are through.

    `response`: the httpx response, open (status 200 checked); `closer`: closes it (the
    `http.stream(...)` context). Errors mid-body are the client's HsxErrors (`wrap`)."""

    def __init__(self, response: Any, closer: Any, *, encoding: str, wrap: Any,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, request_id: str | None = None, server: str = "",
                 account: Any = None) -> None:
        self._resp = response
        self._closer = closer
        self._wrap = wrap  # exception -> HsxError
        self._account = account  # (wire bytes, body bytes, seconds receiving) once the body is through
        self._t0 = time.perf_counter()
        self._parser = BodyParser(chunk_bytes)
        if response.is_stream_consumed:  # a transport that hands back read (decoded) responses: tests' fakes
            self._zstd, self._raw_iter = None, _one(response.content)
        else:
            self._zstd = ZstdPieces() if encoding == "zstd" else None
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

    async def _next_raw(self) -> bytes | None:
        try:
            raw = await self._raw_iter.__anext__()
        except StopAsyncIteration:
            return None
        except Exception as exc:
            raise self._wrap(exc) from exc
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

    async def chunks(self) -> AsyncIterator[StatesChunk]:
        if self._started:
            raise RuntimeError("a sample stream's chunks can be read once")
        self._started = True
        await self.layout()
        pieces: list | None = self._pending
        self._pending = []
        while pieces is not None:
            for p in pieces:
                for c in self._parser.feed(p):
                    yield c
            pieces = await self._next_pieces()
        self._head = self._parser.finish()
        self.receive_s = time.perf_counter() - self._t0
        if self._account is not None:
            self._account(self.wire_bytes, self._parser.body_bytes, self.receive_s)

    async def head(self) -> SampleHead:
        if self._head is None:
            if self._started:
                raise RuntimeError("head() before the chunks were read to their end")
            async for _ in self.chunks():  # states nobody asked for: read past them
                pass
        assert self._head is not None
        return self._head

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._closer()

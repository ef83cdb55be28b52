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

    raw = await stream.collect()                   # or: the whole sample as one body (RawResponse)

Every answer of `POST /hidden_states` is one of three `SampleStream`s, opened by one path
(hsx_client.states_request): an HTTP body read as it arrives (hsx_client.http_stream), the
chunked lease form (hsx_client.lease_stream), or a sample here whole (a lease on one range,
a bf16split body: `WholeSampleStream`, below). A body that is not one sample raises
`ResponseValidationError` from any of them (`malformed_body`).

Over HTTP the body is the one safetensors file of hsx/wire.py (hidden_states first, token-
major, then token_ids and loss_mask), so the ids arrive last: `head()` of an HTTP stream
is known only once its chunks are consumed, and `layout()` (from the header) is what a
writer needs first. A lease stream knows its head at once; `states_layout` serves both.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hsx import dtypes, wire
from hsx_client.errors import HsxError, ResponseValidationError

if TYPE_CHECKING:
    from hsx_client.responses import Lease, RawResponse

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
    """One answer of `POST /hidden_states`, whatever carried it. Close it however it ends."""

    request_id: str | None
    server: str
    wire_bytes: int  # bytes received so far (compressed when the server compressed)
    receive_s: float  # headers in -> last byte in, once the body is through (0 for a lease)
    lease: Lease | None  # a whole lease still held (the other streams hold none between calls)
    taken_bytes: int  # states taken out of a lease into this process's memory

    async def layout(self) -> StatesLayout: ...  # dtype and [T, L, H], before any state

    async def head(self) -> SampleHead: ...

    def chunks(self) -> AsyncIterator[StatesChunk]: ...

    async def take_out(self) -> None: ...  # a lease's states copied here before anything slow

    async def release(self) -> None: ...  # a whole lease given back, strictly (LeaseExpiredError)

    async def collect(self) -> RawResponse: ...  # the whole sample as one body; closes the stream

    async def aclose(self) -> None: ...


@contextlib.contextmanager
def malformed_body(server: str, request_id: str | None) -> Iterator[None]:
    """A body that is not one sample (hsx.wire's WireFormatError, this module's StreamError)
    raised as the client's ResponseValidationError: the one place that says so."""
    try:
        yield
    except wire.WireFormatError as exc:
        raise ResponseValidationError(f"malformed response body: {exc}", request_id=request_id,
                                      server=server) from exc


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


def torch_dtype(st_code: str) -> Any:
    import torch

    dt = dtypes.BY_ST.get(st_code)
    if dt is None:
        raise StreamError(f"hidden_states has unsupported dtype {st_code!r}")
    return getattr(torch, dt.name)


class WholeSampleStream:
    """A sample already here whole (a lease view, a body read whole): one chunk, no copy.
    `take_out()` copies a lease's states here and releases it at once (LeaseExpiredError when
    it had expired): call it before anything slow. Otherwise `release` (a lease's strict
    release) is the caller's once the states are stored; `aclose` gives a lease back quietly.
    `collect()` hands the response over as it is, a lease included (the caller's to release)."""

    def __init__(self, raw: RawResponse, client: Any = None) -> None:
        self._raw = raw
        self._client = client  # hsx_client.api.HsxClient: take_out and release_lease
        self._decoded: wire.Decoded | None = None
        self.lease = raw.lease
        self.request_id = raw.request_id
        self.server = raw.server
        self.wire_bytes = raw.wire_bytes
        self.receive_s = 0.0  # counted by the path that read it (the server's receive_s)
        self.taken_bytes = 0  # the states taken out of a lease (in this process's memory)

    def _decode(self) -> wire.Decoded:
        if self._decoded is None:
            with malformed_body(self.server, self.request_id):
                self._decoded = self._raw.decode()
        return self._decoded

    async def layout(self) -> StatesLayout:
        head = await self.head()
        return StatesLayout(head.dtype, head.shape, head.metadata)

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

    async def collect(self) -> RawResponse:
        self.lease = None  # handed over with the response
        return self._raw

    async def aclose(self) -> None:
        self._decoded = None
        try:
            await self.release()
        except HsxError:
            pass


def _u8() -> Any:
    import torch

    return torch.uint8

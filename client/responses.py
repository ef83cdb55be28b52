"""What a `POST /hidden_states` answer is to the client (`RawResponse`, its `Lease`) and the
helpers of its body: the Accept header asked, the body checked or un-split once it is here."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
import numpy as np

from hsx import bf16split, wire


@dataclass
class Lease:
    """States left in a same-host server's arena: valid until released (see release_lease)."""

    id: str
    server: str
    states: memoryview  # read-only view of the arena range


@dataclass
class RawResponse:
    """A successful `POST /hidden_states`: the decompressed safetensors body and how it came.
    With a lease, `body` lacks the hidden_states bytes: decode with `wire.decode(body,
    lease.states)`, or take them out of the lease first (`HsxClient.take_out`: copied here,
    the lease released at once) and store them after."""

    body: bytes
    request_id: str | None
    server: str
    wire_bytes: int  # bytes on the wire (compressed when the server compressed)
    attempts: int = 1
    lease: Lease | None = None
    states: bytearray | None = None  # the states taken out of a lease (HsxClient.take_out): no lease left

    def decode(self) -> wire.Decoded:
        if self.lease is not None:
            return wire.decode(self.body, self.lease.states)
        return wire.decode(self.body, None if self.states is None else memoryview(self.states))


# A lease copied out above this size is copied in a thread (numpy's copy lets go of the GIL):
# the event loop keeps receiving other samples meanwhile.
THREAD_COPY_BYTES = 4 << 20


def copy_into(out: bytearray | memoryview, view: memoryview) -> None:
    np.copyto(np.frombuffer(out, np.uint8, count=view.nbytes), np.frombuffer(view, np.uint8))


async def copy_out(view: memoryview) -> bytearray:
    """The bytes of `view` (a lease's arena range) in memory of this process."""
    out = bytearray(view.nbytes)
    if view.nbytes >= THREAD_COPY_BYTES:
        await asyncio.to_thread(copy_into, out, view)
    elif view.nbytes:
        copy_into(out, view)
    return out


def finish_body(raw: bytes, compression: str) -> bytes:
    """bf16split or identity bodies (zstd ones are decoded as they arrive: zstd_stream.py)."""
    if compression == "bf16split":
        return bf16split.decode_body(raw)  # checks the result's layout itself
    wire.check_body(raw)
    return raw


def accept_header(lease: bool, split: bool) -> str:
    kinds = ([wire.LEASE_MEDIA_TYPE] if lease else []) + ([bf16split.MEDIA_TYPE] if split else [])
    return ", ".join([*kinds, f"{wire.MEDIA_TYPE};q=0.5"]) if kinds else wire.MEDIA_TYPE


def is_local(url: str) -> bool:
    host = (httpx.URL(url).host or "").lower()
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")

"""The one path of `POST /hidden_states`: the request sent, its answer's headers read, and
the answer opened as the `SampleStream` its headers announce (hsx_client.sample_stream):

    the chunked lease form          -> LeaseStream (hsx_client.lease_stream), the response kept open
    an identity or zstd wire body   -> HttpSampleStream (hsx_client.http_stream), the body left to it
    a lease on one range, bf16split,
    another content coding          -> WholeSampleStream, the (small or whole-only) body read here

`HsxClient.hidden_states_stream` hands the stream on; `hidden_states_response` collects it
(`stream.collect()`) within the same attempt, so a body that breaks off is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx

from hsx import bf16split, wire
from hsx_client import shm
from hsx_client.errors import HsxError, error_from_response
from hsx_client.responses import Lease, RawResponse, accept_header, finish_body
from hsx_client.sample_stream import SampleStream, WholeSampleStream, malformed_body

if TYPE_CHECKING:
    from hsx_client.api import HsxClient
    from hsx_client.servers import ServerState


async def open_states(client: HsxClient, server: ServerState, payload: bytes, rid: str, *,
                      arena: shm.ArenaMap | None, whole: bool, chunk_bytes: int) -> SampleStream:
    """`whole`: the caller collects the body, so bf16split may be asked for (its split planes
    are not token-major: no stream of chunks can be cut from it)."""
    http = client._ensure_open()
    compression = client._compression_for(server.url)
    headers = {
        "Content-Type": "application/json",
        "Accept": accept_header(arena is not None, whole and compression == "bf16split"),
        "Accept-Encoding": client._encoding_for(server.url),
        "X-Request-Id": rid,
    }
    if arena is not None and arena.session:
        headers[shm.SESSION_HEADER] = arena.session
    t_sent = time.perf_counter()
    stack = contextlib.AsyncExitStack()
    try:
        resp = await stack.enter_async_context(
            http.stream("POST", server.url + "/hidden_states", content=payload, headers=headers))
        server.answered = True
        resp_rid = resp.headers.get("x-request-id") or rid
        if resp.status_code != 200:
            content = await resp.aread()
            raise error_from_response(resp.status_code, content, resp.headers, server=server.url,
                                      request_id=resp_rid)
        server.response_s += time.perf_counter() - t_sent  # request sent -> headers in
        return await _answer_stream(client, server, resp, stack.aclose, arena, resp_rid, chunk_bytes)
    except BaseException as exc:
        await stack.aclose()
        if isinstance(exc, httpx.HTTPError):
            raise client._wrap_transport_error(exc, server, rid) from exc
        raise


async def _answer_stream(client: HsxClient, server: ServerState, resp: httpx.Response,
                         close: Callable[[], Awaitable[Any]], arena: shm.ArenaMap | None, rid: str,
                         chunk_bytes: int) -> SampleStream:
    """The stream the headers announce; a stream that keeps the response closes it itself."""
    from hsx_client.http_stream import HttpSampleStream

    encoding = resp.headers.get("content-encoding", "identity").strip().lower() or "identity"
    ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == wire.LEASE_STREAM_MEDIA_TYPE and arena is not None:
        from hsx_client.lease_stream import LeaseStream

        return LeaseStream(client, server.url, resp, close, arena, rid)
    if ctype in (wire.LEASE_MEDIA_TYPE, bf16split.MEDIA_TYPE) or encoding not in ("identity", "zstd"):
        raw = await _read_whole(client, server, resp, ctype, arena, rid)
        await close()
        return WholeSampleStream(raw, client)

    def account(wire_bytes: int, body_bytes: int, receive_s: float, decode_s: float) -> None:
        server.wire_bytes += wire_bytes
        server.body_bytes += body_bytes
        server.receive_s += receive_s
        server.decode_s += decode_s  # what is left after the last byte: the last batch's decode

    return HttpSampleStream(resp, close, encoding=encoding, chunk_bytes=chunk_bytes, request_id=rid,
                            server=server.url, account=account,
                            wrap_transport=lambda exc: client._wrap_transport_error(exc, server, rid))


async def _read_whole(client: HsxClient, server: ServerState, resp: httpx.Response, ctype: str,
                      arena: shm.ArenaMap | None, rid: str) -> RawResponse:
    """A body read whole: a lease on one range, bf16split (a zstd stream of its own, not a
    content coding), or a content coding httpx decodes (gzip...)."""
    t_headers = time.perf_counter()
    if resp.is_stream_consumed:  # a transport that hands back read responses (MockTransport)
        raw, wire_bytes = resp.content, resp.num_bytes_downloaded or len(resp.content)
    elif ctype in (wire.LEASE_MEDIA_TYPE, bf16split.MEDIA_TYPE):
        chunks = [c async for c in resp.aiter_raw()]
        raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        wire_bytes = len(raw)
    else:
        raw = await resp.aread()
        wire_bytes = resp.num_bytes_downloaded
    t_body = time.perf_counter()
    server.receive_s += t_body - t_headers
    lease = None
    with malformed_body(server.url, rid):
        if ctype == wire.LEASE_MEDIA_TYPE:
            lease = await _lease_of(client, server, raw, arena)
            body = raw
        else:
            body = await asyncio.to_thread(finish_body, raw, "bf16split" if ctype == bf16split.MEDIA_TYPE else "identity")
            server.decode_s += time.perf_counter() - t_body
    server.wire_bytes += wire_bytes
    server.body_bytes += len(body) + (len(lease.states) if lease else 0)
    return RawResponse(body=body, request_id=rid, server=server.url, wire_bytes=wire_bytes, lease=lease)


async def _lease_of(client: HsxClient, server: ServerState, raw: bytes, arena: shm.ArenaMap | None) -> Lease:
    if arena is None:
        raise wire.WireFormatError("a lease came back though none was asked for")
    wire.check_body(raw)
    desc = wire.lease_of(raw)
    lease = Lease(desc["id"], server.url, memoryview(b""))
    if desc["arena_id"] != arena.arena_id:  # restarted since we attached
        server.arena, server.arena_note = None, None
        arena.close()
        with contextlib.suppress(HsxError):  # given back now rather than at its expiry
            await client.release_lease(lease)
        raise wire.WireFormatError("the lease names another arena (server restarted?)")
    lease.states = arena.view(int(desc["offset"]), int(desc["nbytes"]))
    return lease

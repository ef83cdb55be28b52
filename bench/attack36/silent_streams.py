"""Same-host clients that take a chunked lease answer and then say nothing (items 4 and 6)."""

from __future__ import annotations

import asyncio
import time

import httpx


async def stall_a_chunked_lease_stream(client: httpx.AsyncClient, url: str, session: str, ids: list[int]):
    """POST ids asking for a lease answer, then read its records as they come but never a
    chunk, and release no lease: the window's slots stay out. Returns the task once the first
    record is here;
    the task ends with (monotonic time the answer ended, its records, 'lease' or 'body')."""
    from hsx.protocol.lease import SESSION_HEADER
    from hsx.wire import LEASE_MEDIA_TYPE, LEASE_STREAM_MEDIA_TYPE, LeaseStreamReader

    started = asyncio.get_running_loop().create_future()

    async def run():
        reader, records, kind = LeaseStreamReader(), [], "lease"
        try:
            async with client.stream("POST", url + "/hidden_states", json={"input_ids": ids},
                                     headers={"Accept": LEASE_MEDIA_TYPE, SESSION_HEADER: session}) as r:
                if r.headers.get("content-type") != LEASE_STREAM_MEDIA_TYPE:  # a body: read it whole
                    kind = "body"
                    await r.aread()
                    started.done() or started.set_result(None)
                    return time.monotonic(), [{"status": r.status_code}], kind
                async for data in r.aiter_raw():
                    records += reader.feed(data)
                    if records and not started.done():
                        started.set_result(None)
        except httpx.HTTPError as exc:
            records.append({"error": type(exc).__name__})
        finally:
            started.done() or started.set_result(None)
        return time.monotonic(), records, kind

    task = asyncio.ensure_future(run())
    await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
    return task

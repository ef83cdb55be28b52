"""The HTTP transport under HsxClient: httpx's API over aiohttp (the `httpx-aiohttp` package).

Decided by measurement (issue 17, item 4: `hsx bench --transport-only`; figures in
bench/results-cpu-2026-12-01-transport.json and bench/README.md, 2-core box, 2026-12-01).
The hand-written HTTP/1.1 transport that was here (client/fast_http.py) had to spend
>= 1.3x less client CPU per GB than the best maintained stack to stay. Over the matrix
(8-200 MiB bodies, identity and zstd, 1-16 in flight) it managed 1.19x against aiohttp
(geomean): 1.46x on identity bodies (~1.9x at 64-200 MiB, but 0.5-0.75x at 8 MiB with
several in flight) and 0.80x on zstd ones (chunked, the remote default). So it went,
with its framing and keep-alive defects. httpx over httpx-aiohttp costs about what
aiohttp alone does on large bodies (1.89x vs 1.98x less CPU per GB than httpx's default
stack, httpcore + h11) and keeps httpx the API: retries, errors and `transport=`
injection (MockTransport in tests, a user's own transport) are unchanged.

Errors are fixed up here: httpx-aiohttp 0.2.0 maps every `aiohttp.ClientConnectionError`
to `httpx.ConnectTimeout`, so a refused connection or a server that closed a pooled
connection would read as "no connection within 5 s" (`_remapped` gives them httpx's own
ConnectError, RemoteProtocolError), and lets other aiohttp errors (a malformed response)
through as they are, which HsxClient would not retry: they become httpx errors too.
"""

from __future__ import annotations

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import AiohttpResponseStream, map_aiohttp_exceptions


def _remapped(exc: httpx.HTTPError) -> httpx.HTTPError:
    cause = exc.__cause__
    if isinstance(cause, aiohttp.ClientConnectorError) and not isinstance(cause.os_error, TimeoutError):
        return httpx.ConnectError(str(cause))
    if isinstance(cause, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(f"server closed the connection: {cause}")
    return exc


class _Body(AiohttpResponseStream):
    async def __aiter__(self):
        try:
            # The bytes of each socket read as they came (`readchunk`), where httpx-aiohttp
            # reads 16 KiB slices (`iter_chunked`): a copy and an await less per 16 KiB, ~10-20%
            # less client CPU per GB (hsx bench --transport-only, 64 MiB bodies, 2026-12-02).
            # The end is `at_eof()`, not aiohttp's `iter_chunks` sentinel: every body-less
            # response (204, a lease release) shares one EmptyStreamReader, which gives the
            # sentinel once per process; after that `iter_chunks` never ends.
            content = self._aiohttp_response.content
            with map_aiohttp_exceptions():
                while True:
                    chunk, _ = await content.readchunk()  # b"" also marks an HTTP chunk's end
                    if chunk:
                        yield chunk
                    elif content.at_eof():
                        break
        except httpx.HTTPError as exc:
            new = _remapped(exc)
            if new is exc:
                raise
            raise new from exc.__cause__
        except aiohttp.ClientError as exc:  # left unmapped by httpx-aiohttp
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from exc


class HsxTransport(AiohttpTransport):
    """AiohttpTransport with one aiohttp session of `connections` connections (made in
    the running loop on first use) and httpx's exception types where it guessed wrong."""

    def __init__(self, connections: int) -> None:
        super().__init__(client=lambda: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections),
            auto_decompress=False))  # HsxClient decodes zstd itself, off the event loop

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            resp = await super().handle_async_request(request)
        except httpx.HTTPError as exc:
            new = _remapped(exc)
            if new is exc:
                raise
            new.request = request
            raise new from exc.__cause__
        except aiohttp.ClientError as exc:  # left unmapped by httpx-aiohttp: a malformed response,
            # e.g. both Content-Length and Transfer-Encoding (RFC 9112 section 6.3), refused
            raise httpx.RemoteProtocolError(f"{type(exc).__name__}: {exc}", request=request) from exc
        inner = getattr(resp.stream, "_aiohttp_response", None)  # errors mid-body remapped too
        if inner is not None:
            resp.stream = _Body(inner)
        return resp

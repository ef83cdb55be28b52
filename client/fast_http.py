"""A lean HTTP/1.1 transport for httpx, for bodies of tens of megabytes at GB/s.

httpx's default stack reads 64 KiB at a time through h11 and anyio; on the H200 host
that capped one client process at ~0.5 GB/s of /hidden_states bodies, a tenth of
what the engine produces (bench, 2026-11-30). This transport keeps httpx's API (so
retries, failover and errors in api.py are unchanged) but receives with an
`asyncio.BufferedProtocol`: a body with a Content-Length lands straight in one
preallocated buffer, whatever the recv sizes. Chunked bodies (zstd responses) are
parsed from a large buffer. Plain http:// only; anything else goes to httpx's own
transport. Errors are httpx's exception types.
"""

from __future__ import annotations

import asyncio
import socket
from collections import defaultdict

import httpx

_HEAD_LIMIT = 64 << 10
_BUF = 4 << 20
_SOCKBUF = 8 << 20
# Flow control: reading pauses once this much is buffered unread (the reader is slow, or
# gone), and resumes when it has taken the buffer below half of it.
_HIGH_WATER = 16 << 20


class _Conn(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray(_BUF)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0
        self._target: memoryview | None = None  # direct mode: body bytes go here
        self._filled = 0
        self._event = asyncio.Event()
        self.closed = False
        self.paused = False
        self.received = 0  # bytes of the current response (a reused connection that got none is retried)

    # -- protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:  # bigger kernel buffers: fewer, larger receives per body
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKBUF)
            except OSError:
                pass

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled :]
        if self._start == self._end:
            self._start = self._end = 0
        if self._end == len(self._buf):
            if self._start:
                n = self._end - self._start
                self._buf[:n] = self._buf[self._start : self._end]
                self._start, self._end = 0, n
            else:
                self._buf.extend(bytes(len(self._buf)))
        return memoryview(self._buf)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self._target is not None:
            self._filled += nbytes
            if self._filled < len(self._target):
                return  # wake the reader once per body, not once per recv
        else:
            self._end += nbytes
            if self._end - self._start >= _HIGH_WATER and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
        self._event.set()

    def _consumed(self) -> None:
        if self.paused and self._end - self._start < _HIGH_WATER // 2 and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        self.closed = True
        self._event.set()
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._event.set()

    # -- reading
    async def _wait(self) -> None:
        if self.closed:
            raise httpx.RemoteProtocolError("server closed the connection")
        self._event.clear()
        await self._event.wait()

    async def read_until(self, sep: bytes, limit: int) -> bytes:
        while True:
            i = self._buf.find(sep, self._start, self._end)
            if i >= 0:
                out = bytes(self._buf[self._start : i])
                self._start = i + len(sep)
                self._consumed()
                return out
            if self._end - self._start > limit:
                raise httpx.RemoteProtocolError("response head too large")
            await self._wait()

    async def read_exactly(self, n: int) -> bytearray:
        out = bytearray(n)
        have = min(n, self._end - self._start)
        out[:have] = self._buf[self._start : self._start + have]
        self._start += have
        self._consumed()
        if have < n:  # the rest is received straight into `out`
            self._target, self._filled = memoryview(out)[have:], 0
            try:
                while self._filled < n - have:
                    self._event.clear()
                    if self.closed:
                        raise httpx.RemoteProtocolError("server closed the connection mid-body")
                    await self._event.wait()
            finally:
                self._target = None
        return out


class FastTransport(httpx.AsyncBaseTransport):
    def __init__(self, max_idle_per_host: int = 64) -> None:
        self._idle: dict[tuple[str, int], list[_Conn]] = defaultdict(list)
        self._max_idle = max_idle_per_host
        self._fallback = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            return await self._fallback.handle_async_request(request)
        timeouts = request.extensions.get("timeout", {})
        key = (request.url.host, request.url.port or 80)
        body = await request.aread()
        conn, reused = await self._connect(key, timeouts.get("connect"))
        try:
            return await self._exchange(conn, key, request, body, timeouts)
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            if not reused or conn.received:
                raise
            # A pooled keep-alive connection the server had closed (its idle timeout) and
            # that answered nothing: once more on a fresh one. Replaying is safe for what
            # HsxClient sends: POST /hidden_states and /tokenize are pure functions of the
            # body (a prefill, a tokenization), GET and DELETE /leases/ID are idempotent.
            conn, _ = await self._connect(key, timeouts.get("connect"), fresh=True)
            try:
                return await self._exchange(conn, key, request, body, timeouts)
            except httpx.HTTPError as again:
                raise again from exc

    async def _exchange(self, conn: _Conn, key, request: httpx.Request, body: bytes, timeouts) -> httpx.Response:
        try:
            head = [f"{request.method} {request.url.raw_path.decode('ascii')} HTTP/1.1".encode()]
            headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"transfer-encoding"]
            if body and not any(k.lower() == b"content-length" for k, _ in headers):
                headers.append((b"Content-Length", str(len(body)).encode()))
            head += [k + b": " + v for k, v in headers]
            if conn.closed:
                raise httpx.RemoteProtocolError("server closed the connection")
            conn.received = 0
            conn.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
            status, resp_headers, content, keep = await asyncio.wait_for(
                self._read_response(conn, request.method), timeouts.get("read")
            )
        except asyncio.TimeoutError as exc:
            conn.transport.close()
            raise httpx.ReadTimeout("no complete response within the read timeout", request=request) from exc
        except httpx.HTTPError:
            conn.transport.close()
            raise
        except (OSError, ValueError) as exc:
            conn.transport.close()
            raise httpx.ReadError(f"{type(exc).__name__}: {exc}", request=request) from exc
        except BaseException:  # cancelled (or worse) mid-exchange: the connection's state is unknown
            conn.transport.close()
            raise
        if keep and not conn.closed and len(self._idle[key]) < self._max_idle:
            self._idle[key].append(conn)
        else:
            conn.transport.close()
        return httpx.Response(status, headers=resp_headers, stream=_Body(content),
                              extensions={"http_version": b"HTTP/1.1"})

    async def _connect(self, key: tuple[str, int], timeout: float | None, fresh: bool = False) -> tuple[_Conn, bool]:
        """(a connection, whether it is a reused one)."""
        idle = self._idle[key]
        while idle and not fresh:
            conn = idle.pop()
            if not conn.closed:
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(_Conn, key[0], key[1]), timeout)
        except asyncio.TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connect to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{exc}") from exc
        return conn, False

    @staticmethod
    async def _read_response(conn: _Conn, method: str):
        raw_head = await conn.read_until(b"\r\n\r\n", _HEAD_LIMIT)
        lines = raw_head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        headers = []
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers.append((k.strip(), v.strip()))
        h = {k.lower(): v.lower() for k, v in headers}
        tokens = {t.strip() for t in h.get(b"connection", b"").split(b",")}
        # HTTP/1.1 persists unless told to close; HTTP/1.0 only when it says keep-alive.
        keep = b"close" not in tokens and (parts[0] != b"HTTP/1.0" or b"keep-alive" in tokens)
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return status, headers, b"", keep
        chunked = h.get(b"transfer-encoding", b"").split(b",")[-1].strip() == b"chunked"
        if chunked:
            # RFC 9112 section 6.3: Transfer-Encoding overrides Content-Length, and a message
            # with both may be an attempt at request smuggling: never reuse its connection.
            keep = keep and b"content-length" not in h
            pieces = []
            while True:
                size = int((await conn.read_until(b"\r\n", 1024)).split(b";")[0], 16)
                if size == 0:
                    while await conn.read_until(b"\r\n", _HEAD_LIMIT):  # trailer fields, then an empty line
                        pass
                    break
                pieces.append(await conn.read_exactly(size))
                if await conn.read_exactly(2) != b"\r\n":
                    raise httpx.RemoteProtocolError("malformed chunked body")
            return status, headers, b"".join(pieces), keep
        if b"content-length" in h:
            return status, headers, await conn.read_exactly(int(h[b"content-length"])), keep
        # Body until close.
        pieces = []
        while not conn.closed:
            pieces.append(bytes(conn._buf[conn._start : conn._end]))
            conn._start = conn._end
            conn._consumed()
            try:
                await conn._wait()
            except httpx.RemoteProtocolError:
                break
        pieces.append(bytes(conn._buf[conn._start : conn._end]))
        return status, headers, b"".join(pieces), False

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
        await self._fallback.aclose()


class _Body(httpx.AsyncByteStream):
    def __init__(self, data: bytes | bytearray) -> None:
        self._data = data

    async def __aiter__(self):
        if self._data:
            yield self._data

    async def aclose(self) -> None:
        self._data = b""

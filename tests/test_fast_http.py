"""client/fast_http.py against a real uvicorn server: framing, keep-alive, failures."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from _asgi import read_body, serve_lifespan
from hsx_client.fast_http import FastTransport

BIG = bytes(range(256)) * (40 << 12)  # 40 MiB, patterned


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        return await serve_lifespan(receive, send)
    body = await read_body(receive)
    path = scope["path"]
    if path == "/big":  # Content-Length, written in uneven pieces
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(BIG)).encode())]})
        for i in range(0, len(BIG), 3_000_001):
            await send({"type": "http.response.body", "body": BIG[i:i + 3_000_001], "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/chunked":  # no Content-Length: uvicorn uses chunked encoding
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-kind", b"chunked")]})
        for i in range(0, len(BIG), 5_000_000):
            await send({"type": "http.response.body", "body": BIG[i:i + 5_000_000], "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/echo":
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    elif path == "/cut":  # promises more than it sends, then the connection drops
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"1000000")]})
        await send({"type": "http.response.body", "body": b"x" * 1000, "more_body": True})
        raise RuntimeError("server dies mid-body")
    elif path == "/slow":
        await asyncio.sleep(3)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
    else:
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def url():
    uvicorn = pytest.importorskip("uvicorn")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="on"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True


async def test_bodies_intact_and_connections_reused(url):
    transport = FastTransport()
    async with httpx.AsyncClient(transport=transport, timeout=30) as c:
        rs = await asyncio.gather(*[c.get(url + p) for p in ["/big", "/chunked"] * 4])
        for r in rs:
            assert r.status_code == 200 and r.content == BIG
        assert rs[1].headers["x-kind"] == "chunked"
        r = await c.post(url + "/echo", content=b"payload" * 1000)
        assert r.status_code == 201 and r.content == b"payload" * 1000
        assert (await c.get(url + "/nope")).status_code == 404
        assert sum(len(v) for v in transport._idle.values()) >= 1  # keep-alive pool in use


async def test_failures_are_httpx_errors(url):
    async with httpx.AsyncClient(transport=FastTransport(), timeout=httpx.Timeout(1.0)) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            await c.get(url + "/cut")
        with pytest.raises(httpx.ReadTimeout):
            await c.get(url + "/slow")
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
        s.close()
        with pytest.raises(httpx.ConnectError):
            await c.get(f"http://127.0.0.1:{dead}/big")
        assert (await c.get(url + "/big")).content == BIG  # still usable afterwards


# ------------------------------------------------------------------ the review's defects (issue 17)
# Each against a raw socket server that says exactly what the case needs.
class RawServer:
    """Accepts connections; `script(sock, n)` answers the n-th request (0-based, over all
    connections) read from `sock`, and returns False to close that connection."""

    def __init__(self, script) -> None:
        self.script, self.requests, self.connections = script, 0, 0
        self.closed_by_peer = threading.Event()
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.lsock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.lsock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")), 0)
                while len(buf) < n:
                    buf += sock.recv(65536)
                buf = buf[n:]
                i, self.requests = self.requests, self.requests + 1
                if self.script(sock, i) is False:
                    return
        except OSError:
            self.closed_by_peer.set()
        finally:
            sock.close()

    def close(self) -> None:
        self.lsock.close()


def pooled(transport: FastTransport) -> int:
    return sum(len(v) for v in transport._idle.values())


async def test_cancelled_request_closes_its_connection():
    """A request cancelled mid-body: its connection is closed (the server's sends fail),
    not left open buffering the rest of a 1 GB body, and never pooled."""
    def script(sock, i):
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
        for _ in range(2000):  # 1 MB a step, slowly: the client is cancelled meanwhile
            sock.sendall(b"x" * 1_000_000)
            time.sleep(0.005)
        return False

    srv = RawServer(script)
    transport = FastTransport()
    async with httpx.AsyncClient(transport=transport, timeout=30) as c:
        task = asyncio.create_task(c.get(srv.url + "/big"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(srv.closed_by_peer.wait, 10), "the connection stayed open"
        assert pooled(transport) == 0
    srv.close()


async def test_reading_pauses_when_nobody_reads():
    """Flow control: a connection whose bytes nobody takes stops reading at the high-water
    mark (the kernel's window then stops the sender) instead of buffering without end."""
    from hsx_client import fast_http

    def script(sock, i):
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n" % (1 << 20) + b"y" * (1 << 20) + b"\r\n"
        for _ in range(200):
            sock.sendall(piece)
        return False

    srv = RawServer(script)
    loop = asyncio.get_running_loop()
    host, port = srv.url.rsplit(":", 1)
    transport, conn = await loop.create_connection(fast_http._Conn, "127.0.0.1", int(port))
    transport.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(1.5)  # nothing reads
    assert conn._end - conn._start < (24 << 20), "buffered without bound"  # 200 MiB were sent
    assert getattr(conn, "paused", False)
    transport.close()
    srv.close()


async def test_pooled_connection_closed_by_the_server_is_retried_on_a_fresh_one():
    """The server closes a keep-alive connection just as the next request arrives (its idle
    timeout): that request is sent again on a new connection, not failed."""
    def script(sock, i):
        if i == 1:  # the second request, on the pooled connection: no answer, closed
            return False
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    srv = RawServer(script)
    transport = FastTransport()
    async with httpx.AsyncClient(transport=transport, timeout=10) as c:
        assert (await c.post(srv.url + "/hidden_states", content=b"{}")).content == b"ok"
        assert pooled(transport) == 1
        assert (await c.post(srv.url + "/hidden_states", content=b"{}")).content == b"ok"
    assert srv.requests == 3 and srv.connections == 2
    srv.close()


async def test_chunked_wins_over_content_length_and_the_connection_is_not_reused():
    def script(sock, i):
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")

    srv = RawServer(script)
    transport = FastTransport()
    async with httpx.AsyncClient(transport=transport, timeout=10) as c:
        assert (await c.get(srv.url + "/")).content == b"hello world"
        assert pooled(transport) == 0
        assert (await c.get(srv.url + "/")).content == b"hello world"
    assert srv.connections == 2
    srv.close()


async def test_trailers_after_the_last_chunk():
    """Trailer fields are read to their empty line: the next response on the same
    connection parses (it used to start with the trailer's leftovers)."""
    def script(sock, i):
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n0\r\nX-Checksum: 123\r\nX-More: 4\r\n\r\n")

    srv = RawServer(script)
    transport = FastTransport()
    async with httpx.AsyncClient(transport=transport, timeout=10) as c:
        for _ in range(3):
            assert (await c.get(srv.url + "/")).content == b"abc"
    assert srv.connections == 1  # kept alive throughout
    srv.close()


@pytest.mark.parametrize("head", [b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n"])
async def test_http10_and_connection_close_are_not_kept_alive(head):
    def script(sock, i):
        sock.sendall(head + b"ok")  # and the socket stays open: only the headers say close

    srv = RawServer(script)
    transport = FastTransport()
    async with httpx.AsyncClient(transport=transport, timeout=10) as c:
        assert (await c.get(srv.url + "/")).content == b"ok"
        assert pooled(transport) == 0
        assert (await c.get(srv.url + "/")).content == b"ok"
    assert srv.connections == 2
    srv.close()

"""client/transport.py (HsxClient's transport) against real servers over real sockets:
framing, keep-alive, cancellation, failures as the httpx types HsxClient tells apart.
The cases a review of the hand-written transport it replaced found (issue 17) stay here."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from _asgi import read_body, serve_lifespan
from hsx_client.api import HsxClient
from hsx_client.transport import HsxTransport

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
    elif path == "/empty":  # no body: aiohttp hands every such response one shared reader
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/stall":  # a third of the body, then silence past the client's read timeout
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"3000000")]})
        await send({"type": "http.response.body", "body": b"x" * 1_000_000, "more_body": True})
        await asyncio.sleep(3)
        await send({"type": "http.response.body", "body": b"x" * 2_000_000})
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


@pytest.mark.timeout(60)  # the old loop spun without yielding: wait_for alone could not stop it
async def test_body_less_responses_one_after_another(url):
    """204s (what a lease release answers) in a row: each ends (a loop that waited for
    aiohttp's end-of-body sentinel hung on the second one, as hsx bench did)."""
    async with httpx.AsyncClient(transport=HsxTransport(2), timeout=10) as c:
        for _ in range(3):
            r = await asyncio.wait_for(c.delete(url + "/empty"), 5)
            assert r.status_code == 204 and r.content == b""
        assert (await c.get(url + "/big")).content == BIG


async def test_bodies_intact_and_connections_reused(url):
    async with httpx.AsyncClient(transport=HsxTransport(8), timeout=30) as c:
        rs = await asyncio.gather(*[c.get(url + p) for p in ["/big", "/chunked"] * 4])
        for r in rs:
            assert r.status_code == 200 and r.content == BIG
        assert rs[1].headers["x-kind"] == "chunked"
        r = await c.post(url + "/echo", content=b"payload" * 1000)
        assert r.status_code == 201 and r.content == b"payload" * 1000
        assert (await c.get(url + "/nope")).status_code == 404


def dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.slow  # > 2 s without an engine
async def test_failures_are_the_right_httpx_errors(url):
    """httpx-aiohttp 0.2.0 alone maps a refused connection to ConnectTimeout (HsxClient
    would say "no connection within 5 s"): client/transport.py gives it ConnectError."""
    async with httpx.AsyncClient(transport=HsxTransport(4), timeout=httpx.Timeout(1.0)) as c:
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            await c.get(url + "/cut")
        with pytest.raises(httpx.ReadTimeout):
            await c.get(url + "/slow")
        with pytest.raises(httpx.ReadTimeout):  # mid-body too: HsxClient retries it as a timeout
            await c.get(url + "/stall")
        with pytest.raises(httpx.ConnectError) as ei:
            await c.get(f"http://127.0.0.1:{dead_port()}/big")
        assert not isinstance(ei.value, httpx.TimeoutException)
        assert (await c.get(url + "/big")).content == BIG  # still usable afterwards


async def test_hsx_client_uses_it_by_default(url):
    async with HsxClient([url]) as client:
        assert isinstance(client._ensure_open()._transport, HsxTransport)


# ------------------------------------------------------------------ the review's cases (issue 17)
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


async def get_each(srv: RawServer, n: int) -> list[bytes]:
    """n GETs one after the other over one client with one connection slot."""
    async with httpx.AsyncClient(transport=HsxTransport(1), timeout=10) as c:
        return [(await c.get(srv.url + "/")).content for _ in range(n)]


async def test_cancelled_request_closes_its_connection():
    """A request cancelled mid-body: its connection is closed (the server's sends fail),
    not left open buffering the rest of a 1 GB body."""
    def script(sock, i):
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
        for _ in range(2000):  # 1 MB a step, slowly: the client is cancelled meanwhile
            sock.sendall(b"x" * 1_000_000)
            time.sleep(0.005)
        return False

    srv = RawServer(script)
    async with httpx.AsyncClient(transport=HsxTransport(2), timeout=30) as c:
        task = asyncio.create_task(c.get(srv.url + "/big"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(srv.closed_by_peer.wait, 10), "the connection stayed open"
    srv.close()


@pytest.mark.slow  # > 2 s without an engine
async def test_pooled_connection_closed_by_the_server_is_retried_by_hsx_client():
    """The server closes a keep-alive connection just as the next request arrives (its idle
    timeout): HsxClient sends it again on a new connection (POST /hidden_states is safe to
    replay: a prefill is a pure function of the body)."""
    from _client_fakes import make_body

    def script(sock, i):
        if i == 1:  # the second request, on the pooled connection: no answer, closed
            return False
        body = make_body([7], "r")
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-safetensors\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)

    srv = RawServer(script)
    async with HsxClient([srv.url], max_attempts=2, backoff_base=0.01, compression="none") as c:
        for _ in range(2):
            assert (await c.hidden_states(input_ids=[7])).token_ids.tolist() == [7]
        assert c.stats()[srv.url]["retries"] >= 1
    assert srv.connections >= 2  # the retry went over a new connection
    srv.close()


async def test_chunked_wins_over_content_length_and_the_connection_is_not_reused():
    """RFC 9112 section 6.3: Transfer-Encoding overrides Content-Length; a message with both
    may be smuggling, so its connection must not serve another request (aiohttp refuses it)."""
    def script(sock, i):
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")

    srv = RawServer(script)
    async with httpx.AsyncClient(transport=HsxTransport(1), timeout=10) as c:
        for _ in range(2):  # refused as malformed (RFC 9112 allows it): never the 3 bytes
            with pytest.raises(httpx.RemoteProtocolError, match="Content-Length"):
                await c.get(srv.url + "/")
    assert srv.connections == 2  # and that connection was not reused
    srv.close()


async def test_trailers_after_the_last_chunk():
    """Trailer fields are read to their empty line: the next response on the same
    connection parses."""
    def script(sock, i):
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n0\r\nX-Checksum: 123\r\nX-More: 4\r\n\r\n")

    srv = RawServer(script)
    assert await get_each(srv, 3) == [b"abc"] * 3
    assert srv.connections == 1  # kept alive throughout
    srv.close()


@pytest.mark.parametrize("head", [b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n"])
async def test_http10_and_connection_close_are_not_kept_alive(head):
    def script(sock, i):
        sock.sendall(head + b"ok")  # and the socket stays open: only the headers say close

    srv = RawServer(script)
    assert await get_each(srv, 2) == [b"ok"] * 2
    assert srv.connections == 2
    srv.close()

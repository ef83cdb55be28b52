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

"""HsxClient: retries, failover, least-loaded choice, typed errors, zstd (CPU, loopback)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import zstandard

from _asgi import read_body, serve_lifespan
from _client_fakes import dead_url, make_body
from hsx import wire
from hsx_client.api import HsxClient
from hsx_client.errors import (
    AuthenticationError,
    BadRequestError,
    ConnectionFailedError,
    PayloadTooLargeError,
    ResponseValidationError,
    RetriesExhaustedError,
    ServersUnreachableError,
    ServerError,
)

L, H = 4, 8


def error_response(status: int, etype: str, message: str, rid: str = "srv-rid", headers=None) -> httpx.Response:
    h = {"X-Request-Id": rid}
    h.update(headers or {})
    return httpx.Response(
        status, json={"error": {"type": etype, "message": message, "request_id": rid}}, headers=h
    )


def ok_response(request: httpx.Request, zstd: bool = True) -> httpx.Response:
    ids = json.loads(request.content)["input_ids"]
    body = make_body(ids, request.headers.get("x-request-id", "x"))
    headers = {"Content-Type": wire.MEDIA_TYPE, "X-Request-Id": request.headers.get("x-request-id", "x")}
    if zstd and "zstd" in request.headers.get("accept-encoding", ""):
        body = zstandard.ZstdCompressor(level=1).compress(body)
        headers["Content-Encoding"] = "zstd"
    return httpx.Response(200, content=body, headers=headers)


def truncated_response(request: httpx.Request) -> httpx.Response:
    """A states response that lost its last 5 bytes (uncompressed: the wire format, not a
    zstd frame, is what finds the damage)."""
    r = ok_response(request, zstd=False)
    return httpx.Response(200, content=r.content[:-5], headers={"Content-Type": wire.MEDIA_TYPE})


def fast_client(servers, transport=None, **kw) -> HsxClient:
    kw.setdefault("backoff_base", 0.01)
    kw.setdefault("backoff_max", 0.05)
    kw.setdefault("unhealthy_cooldown", 0.05)
    kw.setdefault("timeout", 10.0)
    return HsxClient(servers, transport=transport, **kw)


# ------------------------------------------------------------------ a real server
class FakeASGI:
    """Minimal ASGI app: /hidden_states (zstd), /health, /info; `mode` injects faults."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.calls = 0
        self.seen_headers: list[dict[str, str]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await serve_lifespan(receive, send)
        body = await read_body(receive)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        path = scope["path"]
        if path == "/health":
            return await self._send(send, 200, b"{}", {"content-type": "application/json"})
        if path == "/info":
            return await self._send(send, 200, json.dumps({"layer_ids": [2, 4, 6, 8]}).encode(), {})
        self.calls += 1
        self.seen_headers.append(headers)
        if self.mode == "slow":
            await asyncio.sleep(2.0)
        ids = json.loads(body)["input_ids"]
        data = make_body(ids, headers.get("x-request-id", ""))
        extra = {"content-type": wire.MEDIA_TYPE, "x-request-id": headers.get("x-request-id", "")}
        if "zstd" in headers.get("accept-encoding", ""):
            c = zstandard.ZstdCompressor(level=1)
            half = len(data) // 2  # two frames, as a streaming server may send
            data = c.compress(data[:half]) + c.compress(data[half:])
            extra["content-encoding"] = "zstd"
        await self._send(send, 200, data, extra)

    @staticmethod
    async def _send(send, status, body, headers):
        hs = [(k.encode(), v.encode()) for k, v in headers.items()] + [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": hs})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def live_server():
    uvicorn = pytest.importorskip("uvicorn")
    app = FakeASGI()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    th.join(5)
    sock.close()



# ------------------------------------------------------------------ tests
async def test_zstd_over_real_socket(live_server):
    url, app = live_server
    app.mode = "ok"
    async with fast_client([url], api_key="sekret", compression="zstd") as c:
        d = await c.hidden_states(input_ids=[5, 6, 7], request_id="my-id")
        assert d.hidden_states.shape == (3, L, H)
        assert d.token_ids.tolist() == [5, 6, 7]
        assert d.loss_mask.tolist() == [1, 1, 1]
        assert d.metadata["request_id"] == "my-id"
        st = c.stats()[url]
        assert st["ok"] == 1 and st["in_flight"] == 0 and st["healthy"]
        assert 0 < st["wire_bytes"] < st["body_bytes"]  # it really came compressed
        info = await c.info()
        assert info["layer_ids"] == [2, 4, 6, 8]
    h = app.seen_headers[-1]
    assert "zstd" in h["accept-encoding"]
    assert h["authorization"] == "Bearer sekret"
    assert h["x-request-id"] == "my-id"


async def test_compression_auto_skips_zstd_for_local_servers(live_server):
    url, app = live_server
    app.mode = "ok"
    async with fast_client([url]) as c:  # compression="auto", and the server is on 127.0.0.1
        await c.hidden_states(input_ids=[5, 6, 7])
    assert app.seen_headers[-1]["accept-encoding"] == "identity"
    assert HsxClient(["http://gpu-node-3:8001"])._encoding_for("http://gpu-node-3:8001") == "zstd"
    assert HsxClient(["http://localhost:8001"], compression="zstd")._encoding_for("http://localhost:8001") == "zstd"


async def test_failover_connection_refused(live_server):
    url, app = live_server
    app.mode = "ok"
    dead = dead_url()
    async with fast_client([dead, url], unhealthy_cooldown=30.0) as c:
        res = await asyncio.gather(*[c.hidden_states(input_ids=[i, i + 1]) for i in range(6)])
        assert [r.token_ids[0] for r in res] == list(range(6))
        st = c.stats()
        assert not st[dead]["healthy"]
        assert st[dead]["ok"] == 0 and st[dead]["errors"] >= 1
        assert st[url]["ok"] == 6


async def test_timeout_is_retried_then_exhausted(live_server):
    url, app = live_server
    app.mode = "slow"
    try:
        async with fast_client([url], timeout=0.3, max_attempts=2) as c:
            with pytest.raises(RetriesExhaustedError) as ei:
                await c.hidden_states(input_ids=[1])
            assert isinstance(ei.value.last_error, ConnectionFailedError)
            assert ei.value.last_error.type in ("timeout", "no_healthy_server")
    finally:
        app.mode = "ok"


async def test_retry_503_honours_retry_after():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            return error_response(503, "overloaded", "queue full", headers={"Retry-After": "0.2"})
        return ok_response(request)

    async with fast_client(["http://a"], httpx.MockTransport(handler)) as c:
        t0 = time.monotonic()
        raw = await c.hidden_states_response({"input_ids": [1, 2]})
        assert time.monotonic() - t0 >= 0.39
        assert raw.attempts == 3
        assert c.stats()["http://a"]["retries"] == 2
        assert c.stats()["http://a"]["healthy"]  # busy is not unhealthy
    assert calls[1] - calls[0] >= 0.19 and calls[2] - calls[1] >= 0.19


async def test_400_is_not_retried_and_carries_request_id():
    n = 0

    def handler(request):
        nonlocal n
        n += 1
        return error_response(400, "invalid_request", "exactly one of input_ids/prompt/messages", rid="req-42")

    async with fast_client(["http://a"], httpx.MockTransport(handler)) as c:
        with pytest.raises(BadRequestError) as ei:
            await c.hidden_states(input_ids=[1])
    e = ei.value
    assert n == 1
    assert (e.status, e.type, e.request_id, e.server) == (400, "invalid_request", "req-42", "http://a")
    assert "req-42" in str(e) and "exactly one" in str(e)


@pytest.mark.parametrize(
    "status,cls", [(401, AuthenticationError), (413, PayloadTooLargeError), (422, BadRequestError)]
)
async def test_typed_errors(status, cls):
    def handler(request):
        return error_response(status, "t", "m", rid=request.headers["x-request-id"])

    async with fast_client(["http://a"], httpx.MockTransport(handler)) as c:
        with pytest.raises(cls) as ei:
            await c.hidden_states(input_ids=[1], request_id="mine")
    assert ei.value.request_id == "mine" and ei.value.status == status


async def test_failover_on_500_and_server_marked_unhealthy():
    hits = {"a": 0, "b": 0}

    def handler(request):
        host = request.url.host
        if request.url.path == "/health":
            return httpx.Response(503)
        hits[host] += 1
        if host == "a":
            return error_response(500, "engine_error", "engine failed")
        return ok_response(request)

    async with fast_client(["http://a", "http://b"], httpx.MockTransport(handler), unhealthy_cooldown=30) as c:
        for i in range(4):
            d = await c.hidden_states(input_ids=[i])
            assert d.token_ids.tolist() == [i]
        st = c.stats()
    assert hits["a"] == 1 and hits["b"] == 4
    assert not st["http://a"]["healthy"] and st["http://b"]["healthy"]


async def test_500_bounded_retries():
    n = 0

    def handler(request):
        nonlocal n
        if request.url.path == "/health":
            return httpx.Response(200)
        n += 1
        return error_response(500, "engine_error", "boom", rid=f"r{n}")

    async with fast_client(["http://a", "http://b"], httpx.MockTransport(handler), max_server_errors=3) as c:
        with pytest.raises(RetriesExhaustedError) as ei:
            await c.hidden_states(input_ids=[1])
    assert n == 3
    assert isinstance(ei.value.last_error, ServerError)
    assert ei.value.last_error.type == "engine_error"


async def test_a_malformed_body_is_its_own_error_not_a_server_or_connection_error():
    """Retried up to max_attempts, not cut at max_server_errors (no engine failed), and
    neither a ServerError nor a ConnectionFailedError; the stream path raises it too."""
    n = 0

    def handler(request):
        nonlocal n
        if request.url.path == "/health":
            return httpx.Response(200)
        n += 1
        return truncated_response(request)

    async with fast_client(["http://a"], httpx.MockTransport(handler), max_attempts=4, max_server_errors=2,
                           unhealthy_cooldown=0.01) as c:
        with pytest.raises(RetriesExhaustedError) as ei:
            await c.hidden_states(input_ids=[1, 2])
        last = ei.value.last_error
        assert n == 4 and isinstance(last, ResponseValidationError) and last.type == "bad_response"
        assert not isinstance(last, (ServerError, ConnectionFailedError)) and last.server == "http://a"
        stream = await c.hidden_states_stream({"input_ids": [1, 2]})
        try:
            with pytest.raises(ResponseValidationError, match="truncated"):
                async for _ in stream.chunks():
                    pass
        finally:
            await stream.aclose()


async def test_unhealthy_server_probed_then_reused():
    log = []

    def handler(request):
        log.append(request.url.path)
        if request.url.path == "/health":
            return httpx.Response(200)
        if log.count("/hidden_states") == 2:  # it answered once before: a blip, retried
            raise httpx.ConnectError("refused")
        return ok_response(request)

    async with fast_client(["http://a"], httpx.MockTransport(handler), unhealthy_cooldown=0.1) as c:
        await c.hidden_states(input_ids=[2])
        t0 = time.monotonic()
        d = await c.hidden_states(input_ids=[3])
        assert time.monotonic() - t0 >= 0.09  # waited for the cooldown
        assert d.token_ids.tolist() == [3]
        assert c.stats()["http://a"]["healthy"]
    assert log == ["/hidden_states", "/hidden_states", "/health", "/hidden_states"]


async def test_all_servers_down_exhausts():
    """Servers that answered once and then all went down: bounded retries, then give up."""
    down = False

    def handler(request):
        if down:
            raise httpx.ConnectError("connection refused")
        return ok_response(request)

    async with fast_client(["http://a", "http://b"], httpx.MockTransport(handler), max_attempts=4) as c:
        await asyncio.gather(c.hidden_states(input_ids=[1]), c.hidden_states(input_ids=[2]))
        down = True
        t0 = time.monotonic()
        with pytest.raises(RetriesExhaustedError) as ei:
            await c.hidden_states(input_ids=[1])
        assert time.monotonic() - t0 < 5
    assert isinstance(ei.value.last_error, ConnectionFailedError)
    assert ei.value.attempts == 4


async def test_servers_that_never_answered_fail_at_once():
    """A wrong port: one clear error within a second, no retry storm (issue 10: 132 s of
    silence before), naming every URL."""
    asked = []

    def handler(request):
        asked.append(request.url.host)
        raise httpx.ConnectError("[Errno 111] Connection refused")

    async with fast_client(["http://a", "http://b"], httpx.MockTransport(handler), max_attempts=10) as c:
        t0 = time.monotonic()
        with pytest.raises(ServersUnreachableError) as ei:
            await c.hidden_states(input_ids=[1])
        assert time.monotonic() - t0 < 1
        assert "http://a" in str(ei.value) and "http://b" in str(ei.value) and "hsx serve" in str(ei.value)
        assert sorted(asked) == ["a", "b"]  # one connection attempt each
        with pytest.raises(ServersUnreachableError):  # and later calls fail at once too
            await c.info()
        assert len(asked) == 2


async def test_the_readme_snippet_against_a_dead_url_fails_within_seconds():
    """README's library snippet, on a real socket where nothing listens."""
    t0 = time.monotonic()
    with pytest.raises(ServersUnreachableError, match="ConnectError"):
        async with HsxClient([dead_url()]) as client:
            await client.hidden_states(messages=[{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello!"}])
    assert time.monotonic() - t0 < 5


async def test_a_server_that_never_answered_is_set_aside_the_others_serve(live_server):
    url, app = live_server
    app.mode = "ok"
    dead = dead_url()
    async with fast_client([dead, url]) as c:
        for i in range(4):
            assert (await c.hidden_states(input_ids=[i])).token_ids.tolist() == [i]
        st = c.stats()
        assert st[dead]["errors"] == 1 and st[url]["ok"] == 4  # tried once, never again


async def test_least_loaded_and_bounded_concurrency():
    release = asyncio.Event()
    started: list[str] = []

    async def handler(request):
        started.append(request.url.host)
        await release.wait()
        return ok_response(request)

    async with fast_client(["http://a", "http://b"], httpx.MockTransport(handler), concurrency_per_server=3) as c:
        tasks = [asyncio.create_task(c.hidden_states(input_ids=[i])) for i in range(8)]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(started) == 6:
                break
        await asyncio.sleep(0.05)
        st = c.stats()
        assert st["http://a"]["in_flight"] == 3 and st["http://b"]["in_flight"] == 3
        assert len(started) == 6  # two wait for a free slot
        assert started[:2] in (["a", "b"], ["b", "a"])  # alternate while loads are equal
        release.set()
        res = await asyncio.gather(*tasks)
        assert sorted(int(r.token_ids[0]) for r in res) == list(range(8))
        st = c.stats()
        assert st["http://a"]["ok"] + st["http://b"]["ok"] == 8
        assert st["http://a"]["in_flight"] == st["http://b"]["in_flight"] == 0


async def test_prefers_idle_server():
    gate = asyncio.Event()

    async def handler(request):
        if request.url.host == "a":
            await gate.wait()
        return ok_response(request)

    async with fast_client(["http://a", "http://b"], httpx.MockTransport(handler)) as c:
        slow = asyncio.create_task(c.hidden_states(input_ids=[0]))  # occupies a
        await asyncio.sleep(0.02)
        for i in range(5):  # b is idle each time: all go there
            await c.hidden_states(input_ids=[i])
        assert c.stats()["http://b"]["ok"] == 5
        gate.set()
        await slow


async def test_truncated_body_is_retried():
    n = 0

    def handler(request):
        nonlocal n
        if request.url.path == "/health":
            return httpx.Response(200)
        n += 1
        return truncated_response(request) if n == 1 else ok_response(request, zstd=False)

    async with fast_client(["http://a"], httpx.MockTransport(handler), unhealthy_cooldown=0.01) as c:
        d = await c.hidden_states(input_ids=[1, 2, 3])
    assert d.token_ids.tolist() == [1, 2, 3] and n == 2


async def test_final_norm_and_raw():
    import safetensors.numpy

    w = np.linspace(0.5, 1.5, H, dtype=np.float32)
    fn_body = safetensors.numpy.save({"weight": w}, metadata={"eps": "1e-05", "style": "gemma"})

    def handler(request):
        if request.url.path == "/final_norm":
            return httpx.Response(200, content=fn_body)
        return ok_response(request)

    async with fast_client(["http://a"], httpx.MockTransport(handler)) as c:
        fn = await c.final_norm()
        raw = await c.hidden_states_raw({"input_ids": [9, 9]})
    assert np.array_equal(fn.weight, w) and fn.eps == 1e-5 and fn.style == "gemma"
    assert type(fn).__module__ == "hsx_client.postnorm"
    assert wire.decode(raw).token_ids.tolist() == [9, 9]


async def test_server_infos_asks_every_server_once_and_leaves_out_the_down_ones():
    asked = []

    def handler(request):
        asked.append((request.url.host, request.url.path))
        if request.url.host == "down":
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json={"model": request.url.host})

    async with fast_client(["http://a", "http://down", "http://b"], httpx.MockTransport(handler)) as c:
        infos = await c.server_infos()
    assert infos == {"http://a": {"model": "a"}, "http://b": {"model": "b"}}
    assert sorted(asked) == [("a", "/info"), ("b", "/info"), ("down", "/info")]  # no retries


def test_client_import_is_light():
    import subprocess
    import sys

    code = (
        "import sys, hsx_client.api, hsx_client.corpus.cli, hsx_client.corpus.extract, hsx_client.corpus.store, hsx_client.corpus.progress;"
        "bad=[m for m in ('vllm','fastapi','uvicorn') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


async def test_a_chunk_lease_that_expires_while_collected_is_asked_again_as_an_http_body(monkeypatch):
    """A whole-response caller whose chunked lease answer loses a chunk lease (a loaded box:
    the release came after --lease-timeout) gets the sample as an HTTP body, not the 410;
    without lease_ok the 410 cannot happen and nothing is asked twice. The real server:
    tests/service/test_chunked_states.py."""
    from hsx_client.errors import LeaseExpiredError

    asked: list[bool] = []

    async with fast_client(["http://a"], httpx.MockTransport(ok_response)) as c:
        open_states = c._open_states

        class _ExpiredChunks:
            async def collect(self):
                c.note_lease_expired("http://a")
                raise LeaseExpiredError("the server ended the sample", status=410, type="lease_gone", server="http://a")

        async def leased_then_http(server, payload, rid, lease_ok, **kw):
            asked.append(lease_ok)
            return _ExpiredChunks() if lease_ok else await open_states(server, payload, rid, lease_ok, **kw)

        monkeypatch.setattr(c, "_open_states", leased_then_http)
        raw = await c.hidden_states_response({"input_ids": [1, 2, 3]}, lease_ok=True)
        assert raw.lease is None and raw.decode().token_ids.tolist() == [1, 2, 3]
        assert asked == [True, False] and c.stats()["http://a"]["leases_expired"] == 1

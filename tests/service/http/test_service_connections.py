"""Connections that never finish their headers, and too many connections (issue 25):
service/http/connections.py on a real uvicorn server over loopback sockets, with both of
uvicorn's HTTP parsers, the guard middleware in front of a small app (no engine: the
engine server's own check is in test_service_hostile.py). Fast: bounded loops, short
deadlines, a few dozen connections.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client import generate_latest

from hsx_tools.server_process import MetricValues
from hsx_service.core.admission import AdmissionGate
from hsx_service.http.connections import PROBE_RESERVE, ConnectionGuard, guarded_protocol
from hsx_service.http.guard import GuardMiddleware
from hsx_service.core.metrics import Metrics
from hsx_service.settings import ServiceSettings

HEADER_TIMEOUT = 0.5
CAP = 16


class App:
    """/health answers at once; /slow holds its answer until `release` is set."""

    def __init__(self):
        self.release = threading.Event()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/slow":
            while not self.release.is_set():
                await asyncio.sleep(0.02)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=["httptools", "h11"])
def uvicorn_server(request):
    """Not named `server`: conftest's engine guard knows fixtures by name, and `server` elsewhere starts an engine."""
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    base = {"httptools": HttpToolsProtocol, "h11": H11Protocol}[request.param]
    metrics = Metrics()
    settings = ServiceSettings(header_timeout=HEADER_TIMEOUT, max_connections=CAP)
    guard = ConnectionGuard(settings.max_connections, settings.header_timeout, metrics)
    app = App()
    wrapped = GuardMiddleware(app, settings=settings, gate=AdmissionGate(8, 1000, metrics), metrics=metrics)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(wrapped, http=guarded_protocol(guard, base), log_level="warning", lifespan="off",
                            timeout_keep_alive=30)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    port = sock.getsockname()[1]
    yield type("S", (), {"port": port, "url": f"http://127.0.0.1:{port}", "guard": guard, "app": app,
                         "metrics": lambda: MetricValues(generate_latest(metrics.registry).decode())})
    app.release.set()
    srv.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the connection open."""
    s.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return got
            got += chunk
    except socket.timeout:
        return None
    except ConnectionResetError:
        return got


@pytest.mark.slow  # waits out the header deadline
def test_silent_and_slow_header_connections_are_closed_after_the_deadline(uvicorn_server):
    silent = [_connect(uvicorn_server.port) for _ in range(6)]
    slow = [_connect(uvicorn_server.port) for _ in range(6)]
    t0 = time.monotonic()
    # One header byte each every 0.1 s (the slowloris: a byte a second).
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    for i in range(4):
        for s in slow:
            s.sendall(request[i:i + 1])
        time.sleep(0.1)
    # Meanwhile a normal request is answered at once.
    r = httpx.get(uvicorn_server.url + "/health", timeout=2)
    assert r.status_code == 200
    for s in silent:
        assert _closed_within(s, 5) == b""  # closed, nothing said: nothing had come
    for s in slow:
        got = _closed_within(s, 5)
        assert got is not None and got.startswith(b"HTTP/1.1 408"), got
    took = time.monotonic() - t0
    assert HEADER_TIMEOUT <= took < HEADER_TIMEOUT + 3
    assert uvicorn_server.metrics().get("hsx_connections_shed_total", reason="header_timeout") == 12
    # A keep-alive connection's next request is bounded the same way, from its first byte.
    with _connect(uvicorn_server.port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(HEADER_TIMEOUT + 0.3)  # idle after a response: uvicorn's keep-alive timeout, not this one
        s.sendall(b"GET /hea")
        got = _closed_within(s, 5)
        assert got is not None and got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in got, got


def test_beyond_the_cap_idle_connections_make_room_and_are_counted(uvicorn_server):
    flood = [_connect(uvicorn_server.port) for _ in range(3 * CAP)]
    time.sleep(0.1)
    assert len(uvicorn_server.guard.open) <= CAP
    t = time.monotonic()
    r = httpx.get(uvicorn_server.url + "/health", timeout=2)
    assert r.status_code == 200 and time.monotonic() - t < 1.0
    m = uvicorn_server.metrics()
    assert m.get("hsx_connections_shed_total", reason="evicted") >= 2 * CAP
    assert m.get("hsx_connections_open") <= CAP
    closed = sum(_closed_within(s, 0.01) is not None for s in flood)  # the oldest were closed
    assert closed >= 2 * CAP
    for s in flood:
        s.close()


def test_when_every_connection_is_busy_the_probes_still_answer(uvicorn_server):
    async def scenario():
        async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=None)) as c:
            busy = [asyncio.ensure_future(c.get(uvicorn_server.url + "/slow")) for _ in range(CAP)]
            while len(uvicorn_server.guard.open) < CAP:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            async with httpx.AsyncClient(timeout=5) as probe:  # a connection of its own
                health = await probe.get(uvicorn_server.url + "/health")
            async with httpx.AsyncClient(timeout=5) as other:
                refused_route = await other.get(uvicorn_server.url + "/slow")
            # Silent connections beyond the reserve take each other's places, never a busy one's.
            held = [_connect(uvicorn_server.port) for _ in range(2 * PROBE_RESERVE)]
            await asyncio.sleep(0.1)
            closed = sum([await asyncio.to_thread(_closed_within, h, 0.01) is not None for h in held])
            uvicorn_server.app.release.set()
            done = await asyncio.gather(*busy)
            for h in held:
                h.close()
            return health, refused_route, closed, done

    health, refused_route, closed, done = asyncio.run(scenario())
    assert health.status_code == 200
    assert refused_route.status_code == 503 and "--max-connections" in refused_route.json()["error"]["message"]
    assert closed >= PROBE_RESERVE
    assert [r.status_code for r in done] == [200] * CAP  # the busy ones were never touched
    assert uvicorn_server.metrics().get("hsx_rejected_total", reason="connections") == 1


class Busy:
    """A connection as ConnectionGuard sees it: with a request in progress, or waiting."""

    def __init__(self, waiting=False):
        self.waiting, self.probe_only, self.closed = waiting, False, None

    def close_now(self, reason):
        self.closed = reason


def test_only_when_every_connection_and_the_reserve_are_busy_is_a_new_one_refused():
    metrics = Metrics()
    guard = ConnectionGuard(CAP, 1.0, metrics)
    for _ in range(CAP):
        guard.open[Busy()] = None
    idle = Busy(waiting=True)
    guard.open[idle] = None
    guard.probe_only = 1  # the idle one took the reserve's first place
    idle.probe_only = True
    assert guard.admit(Busy()) == "probe_only" and idle.closed == "evicted"  # its place, its kind
    del guard.open[idle]
    for _ in range(PROBE_RESERVE):
        guard.open[Busy()] = None
    guard.probe_only = PROBE_RESERVE
    assert guard.admit(Busy()) == "refused"
    values = MetricValues(generate_latest(metrics.registry).decode())
    assert values.get("hsx_connections_shed_total", reason="refused") == 1

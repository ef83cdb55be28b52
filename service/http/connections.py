"""The connections one process serves, bounded before any request exists.

uvicorn closes a connection that sits idle after a response (its keep-alive timeout),
but nothing else: a client that connects and says nothing, or sends its headers a byte
at a time, holds its connection and a file descriptor for as long as it likes, and
enough of them leave the process no descriptor to accept /health with. The ASGI app
never sees such a connection (no request exists yet), so the bounds live in uvicorn's
HTTP protocol, subclassed here (httptools or h11, whichever uvicorn picks: only what
both share is used):

- header deadline: a connection waiting for a request's headers (a new one, or one
  whose next request has begun to arrive) has --header-timeout seconds to complete
  them; then it is closed (408 when part of a request had come).
- a cap of --max-connections open connections (never more than the descriptor limit
  allows, less a reserve for the engine's own files): at the cap a new connection
  closes the longest-waiting one that has no request in progress (silent, slow or idle
  between requests: evicted), so such connections cannot lock anyone out. When every
  connection has a request in progress, PROBE_RESERVE more are accepted for the probes
  (the guard answers anything else on them 503); beyond that a new one gets a 503 and
  is closed (refused).

Every closing is counted in `hsx_connections_shed_total{reason}` (header_timeout,
evicted, refused) and logged, at most one line every LOG_EVERY seconds. With
--http-workers each worker bounds the connections it accepts itself (its counters are
its own: the log lines show them).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from hsx_service.core.metrics import Metrics
from hsx_service.settings import ServiceSettings

log = logging.getLogger("hsx.connections")

PROBE_RESERVE = 16  # connections beyond the cap, for /health, /ready and /metrics only
PROBE_ONLY = "hsx_probe_only"  # in the request scope's state of such a connection (guard.py)
FD_RESERVE = 512  # descriptors kept for the engine, its files, pipes and sockets
LOG_EVERY = 10.0
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_REFUSAL_BODY = (b'{"error": {"type": "overloaded", "message": "too many open connections '
                 b'(--max-connections); retry shortly", "request_id": null}}')
_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s")


class ConnectionGuard:
    """The bounds shared by every connection of one server (see the module docstring)."""

    def __init__(self, max_connections: int, header_timeout: float, metrics: Metrics | None = None):
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.metrics = metrics
        self.open: dict[object, None] = {}  # protocols, oldest first
        self.probe_only = 0
        self._shed: dict[str, int] = {}  # since the last log line
        self._logged_at = 0.0
        if metrics is not None:
            metrics.connections_open.set_function(lambda: len(self.open))

    @property
    def cap(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)  # vLLM raises it while starting
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(PROBE_RESERVE, min(self.max_connections, soft - FD_RESERVE - PROBE_RESERVE))

    def admit(self, protocol) -> str:
        """'ok', 'probe_only' or 'refused' for a new connection (evicting one if need be)."""
        if len(self.open) - self.probe_only < self.cap:
            return "ok"
        for other in self.open:  # the oldest first
            if other.waiting:
                kind = "probe_only" if other.probe_only else "ok"  # the newcomer takes its place
                other.close_now("evicted")
                return kind
        if self.probe_only < PROBE_RESERVE:
            return "probe_only"
        self.shed("refused")
        return "refused"

    def shed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.connections_shed.labels(reason).inc()
        self._shed[reason] = self._shed.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY:
            what = ", ".join(f"{n} {r.replace('_', ' ')}" for r, n in sorted(self._shed.items()))
            log.warning("closed connections: %s (%d open; --max-connections %d, --header-timeout %gs)",
                        what, len(self.open), self.cap, self.header_timeout)
            self._shed.clear()
            self._logged_at = now


class _GuardedProtocol:
    """The bounds a ConnectionGuard sets, mixed in before one of uvicorn's HTTP protocol
    classes (guarded_protocol): admission, the header deadline, the count of open connections."""

    _guard: ConnectionGuard  # set by guarded_protocol on the class it makes
    _admitted = False
    _deadline: asyncio.TimerHandle | None = None
    _waiting_for = None  # the request cycle that was current when the deadline was set
    _partial = False  # bytes of a request whose headers are not complete
    probe_only = False

    @property
    def waiting(self) -> bool:
        """No request in progress: waiting for (the rest of) the next one's headers."""
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport) -> None:
        verdict = self._guard.admit(self)
        if verdict == "refused":
            transport.write(_REFUSAL % (len(_REFUSAL_BODY), _REFUSAL_BODY))
            transport.close()
            return
        self._admitted = True
        self._guard.open[self] = None
        if verdict == "probe_only":
            self._guard.probe_only += 1
            self.probe_only = True
            self.app_state = {**self.app_state, PROBE_ONLY: True}  # copied into each request's scope
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if self.waiting and (self._deadline is None or self._waiting_for is not self.cycle):
            self._arm()
        super().data_received(data)
        self._partial = self.waiting
        if not self._partial:  # a request's headers are in: its body and answer have their own bounds
            self._disarm()

    def eof_received(self):
        if self._admitted:
            return super().eof_received()

    def connection_lost(self, exc) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._disarm()
        self._forget()
        super().connection_lost(exc)

    def _forget(self) -> None:
        """Out of the guard's count, once (at its closing: the transport ends soon after)."""
        if self in self._guard.open:
            del self._guard.open[self]
            self._guard.probe_only -= self.probe_only

    def _arm(self) -> None:
        self._disarm()
        self._waiting_for = self.cycle
        self._deadline = self.loop.call_later(self._guard.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self._admitted and self.waiting and self.cycle is self._waiting_for:
            if self._partial:
                body = (b'{"error": {"type": "header_timeout", "message": "the request headers did not arrive '
                        b'within the server\'s --header-timeout", "request_id": null}}')
                self.transport.write(_TIMEOUT % (len(body), body))
            self.close_now("header_timeout")

    def close_now(self, reason: str) -> None:
        self._forget()
        self._guard.shed(reason)
        self._disarm()
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(guard: ConnectionGuard, base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type:
    """uvicorn's HTTP protocol class with `guard`'s bounds (uvicorn.Config(http=...))."""
    return type(f"Guarded{base.__name__}", (_GuardedProtocol, base), {"_guard": guard})


def protocol_for(settings: ServiceSettings, metrics: Metrics | None) -> type:
    return guarded_protocol(ConnectionGuard(settings.max_connections, settings.header_timeout, metrics))

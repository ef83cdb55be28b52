"""Which server gets the next request of an HsxClient, and what a failure does to it:
least-loaded scheduling, health probes, bounded retries with backoff (the policy is
described in hsx_client.api's docstring)."""

from __future__ import annotations

import asyncio
import contextvars
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from hsx_client import shm

from .errors import (
    ConnectionFailedError, HsxError, RequestTimeoutError, ResponseValidationError, RetriesExhaustedError,
    ServerBusyError, ServerError, ServersUnreachableError,
)

T = TypeVar("T")

# A server URL the requests of this task go to while it is healthy (others only when it is
# not): one-pass regeneration (hsx_client.regenerate.one_pass) sends a conversation's
# generation and its states request to one server, whose prefix cache then holds the states.
AFFINITY: contextvars.ContextVar[str | None] = contextvars.ContextVar("hsx_server_affinity", default=None)

_RETRY_AFTER_CAP = 300.0


@dataclass
class ServerState:
    url: str
    capacity: int
    in_flight: int = 0
    ok: int = 0
    refused: int = 0  # 4xx answers about the request itself (bad input, a row dropped by policy)
    retries: int = 0
    errors: int = 0
    leases_expired: int = 0  # leases found expired at their release: those samples were asked again
    healthy: bool = True
    unhealthy_until: float = 0.0
    busy_until: float = 0.0
    probing: bool = False
    last_pick: int = 0
    wire_bytes: int = 0
    body_bytes: int = 0
    response_s: float = 0.0  # summed over bodies: request sent -> response headers in (bench's profile)
    receive_s: float = 0.0  # summed over bodies: headers in -> last byte in
    decode_s: float = 0.0  # summed: decompression and body checks
    last_error: str | None = None
    arena: shm.ArenaMap | None = None  # same-host lease mapping, once attached
    arena_note: str | None = None  # why leases are not used with this server
    arena_lock: asyncio.Lock | None = None
    answered: bool = False  # some HTTP answer (any status) came back from it once
    unreachable: bool = False  # its first contact failed to connect: set aside for this client's life

    def as_dict(self) -> dict[str, Any]:
        return {
            "in_flight": self.in_flight,
            "ok": self.ok,
            "refused": self.refused,
            "retries": self.retries,
            "errors": self.errors,
            "leases_expired": self.leases_expired,
            "healthy": self.healthy,
            "wire_bytes": self.wire_bytes,
            "body_bytes": self.body_bytes,
            "response_s": self.response_s,
            "receive_s": self.receive_s,
            "decode_s": self.decode_s,
            "last_error": self.last_error,
            "transfer": "shm-lease" if self.arena is not None else "http",
        }


class ServerSet:
    """The servers of one client and their counters; single-threaded (the event loop)."""

    def __init__(self, urls: list[str], capacity: int, *, max_attempts: int, backoff_base: float,
                 backoff_max: float, unhealthy_cooldown: float, max_server_errors: int, probe_timeout: float,
                 http: Callable[[], httpx.AsyncClient]) -> None:
        self.servers = [ServerState(u, capacity) for u in urls]
        self.by_url = {s.url: s for s in self.servers}
        self.max_attempts = max_attempts
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.unhealthy_cooldown = unhealthy_cooldown
        self.max_server_errors = max_server_errors
        self.probe_timeout = probe_timeout
        self._http = http  # the client's httpx client (opened on first use)
        self._changed: asyncio.Event | None = None
        self._probe_tasks: set[asyncio.Task[None]] = set()
        self._probe_failures = 0
        self._picks = 0
        self.closed = False

    def open(self) -> None:
        self._changed = asyncio.Event()

    async def close(self) -> None:
        self.closed = True
        for t in list(self._probe_tasks):
            t.cancel()
        if self._probe_tasks:
            await asyncio.gather(*self._probe_tasks, return_exceptions=True)
        for s in self.servers:
            if s.arena is not None:
                s.arena.close()
                s.arena = None
        self.notify()

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float | None) -> None:
        ev = self._changed
        assert ev is not None
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def first_contact_failed(self, s: ServerState, error: HsxError) -> bool:
        """A connection error from a server that never answered sets it aside for good
        (only servers that answered once are retried). True when it did."""
        connect = isinstance(error, ConnectionFailedError) and not (
            isinstance(error, RequestTimeoutError) and error.type != "connect_timeout")
        if connect and not s.answered:
            s.unreachable, s.healthy = True, False
            s.last_error = error.message
            return True
        return False

    def unreachable_error(self) -> ServersUnreachableError | None:
        if not all(s.unreachable for s in self.servers):
            return None
        why = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
        return ServersUnreachableError(
            f"no server answered ({why}); is `hsx serve` running there? check the URL and port",
            type="unreachable",
        )

    def _start_due_probes(self, now: float) -> None:
        for s in self.servers:
            if not s.healthy and not s.probing and not s.unreachable and s.unhealthy_until <= now:
                s.probing = True
                task = asyncio.get_running_loop().create_task(self._probe(s))
                self._probe_tasks.add(task)
                task.add_done_callback(self._probe_tasks.discard)

    async def _probe(self, s: ServerState) -> None:
        ok = False
        try:
            r = await self._http().get(s.url + "/health", timeout=self.probe_timeout)
            ok = r.status_code == 200
            if not ok:
                s.last_error = f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            s.last_error = f"/health: {type(exc).__name__}: {exc}"
        except RuntimeError:  # closed meanwhile
            pass
        finally:
            s.probing = False
            if ok:
                s.healthy = True
            else:
                s.unhealthy_until = time.monotonic() + self.unhealthy_cooldown
                self._probe_failures += 1
            self.notify()

    async def acquire(self) -> ServerState:
        self._http()  # opens the client, and this set with it, on first use
        failures_at_start = self._probe_failures
        while True:
            if self.closed:
                raise RuntimeError("HsxClient is closed")
            gone = self.unreachable_error()
            if gone is not None:
                raise gone
            now = time.monotonic()
            self._start_due_probes(now)
            healthy = [s for s in self.servers if s.healthy]
            wanted = AFFINITY.get()
            if wanted is not None and any(s.url == wanted for s in healthy):
                healthy = [s for s in healthy if s.url == wanted]  # wait for it rather than go elsewhere
            free = [s for s in healthy if s.in_flight < s.capacity]
            if free:
                best = min(free, key=lambda s: (s.busy_until > now, s.in_flight, s.last_pick))
                best.in_flight += 1
                self._picks += 1
                best.last_pick = self._picks
                return best
            if healthy:
                due = [s.unhealthy_until - now for s in self.servers
                       if not s.healthy and not s.probing and not s.unreachable]
                await self._wait_change(max(0.01, min(due)) if due else None)
                continue
            # Nothing healthy: wait for a probe; a failed one costs this request an attempt.
            if self._probe_failures > failures_at_start:
                last = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
                raise ConnectionFailedError(f"no healthy server ({last})", type="no_healthy_server")
            due = [s.unhealthy_until - now for s in self.servers if not s.probing and not s.unreachable]
            await self._wait_change(max(0.01, min(due)) if due else None)

    def release(self, s: ServerState, error: HsxError | None) -> None:
        """The one place a request's outcome becomes the server's health: a refusal (4xx) is
        the request's fault; busy waits out its Retry-After; a lost connection, a 5xx or a
        malformed body sets the server aside for the cooldown (only the 5xx counts toward
        `max_server_errors`, in `with_retries`)."""
        s.in_flight -= 1
        if error is None:
            s.ok += 1
        elif error.status is not None and 400 <= error.status < 500 and not error.retryable:
            s.refused += 1  # the server did its job; the request was refused (not a server error)
        else:
            s.errors += 1
            s.last_error = str(error)
            if self.first_contact_failed(s, error):
                pass
            elif isinstance(error, ServerBusyError):
                s.busy_until = time.monotonic() + (error.retry_after or self.backoff_base)
            elif isinstance(error, (ConnectionFailedError, ServerError, ResponseValidationError)):
                s.healthy = False
                s.unhealthy_until = time.monotonic() + self.unhealthy_cooldown
        self.notify()

    def _backoff(self, attempt: int, error: HsxError, failed: ServerState | None) -> float:
        now = time.monotonic()
        others = [
            s
            for s in self.servers
            if s is not failed and s.healthy and s.busy_until <= now and s.in_flight < s.capacity
        ]
        if others and failed is not None:
            return 0.0  # fail over at once
        delay = random.uniform(0.0, min(self.backoff_max, self.backoff_base * 2 ** (attempt - 1)))
        ra = getattr(error, "retry_after", None)
        if ra:
            delay = max(delay, min(ra, _RETRY_AFTER_CAP))
        return delay

    async def with_retries(self, fn: Callable[[ServerState, str], Awaitable[T]], request_id: str | None) -> T:
        """`fn(server, request_id)` on the least-loaded healthy server, retried as the
        policy says; raises its non-retryable errors, or RetriesExhaustedError."""
        rid = request_id or uuid.uuid4().hex
        last: HsxError | None = None
        server_errors = 0
        attempt = 0
        while attempt < self.max_attempts:
            attempt += 1
            failed: ServerState | None = None
            try:
                server = await self.acquire()
            except ServersUnreachableError as exc:
                exc.request_id = exc.request_id or rid
                raise
            except ConnectionFailedError as exc:
                exc.request_id = exc.request_id or rid
                last = exc
            else:
                try:
                    result = await fn(server, rid)
                except HsxError as exc:
                    self.release(server, exc)
                    if not exc.retryable:
                        raise
                    last = exc
                    failed = server
                except BaseException:  # cancelled, or a bug: give the slot back
                    server.in_flight -= 1
                    self.notify()
                    raise
                else:
                    self.release(server, None)
                    if hasattr(result, "attempts"):  # a RawResponse says how many it took
                        result.attempts = attempt
                    return result
            assert last is not None
            if isinstance(last, ServerError):
                server_errors += 1
                if server_errors >= self.max_server_errors:
                    break
            if attempt >= self.max_attempts:
                break
            if failed is not None:
                failed.retries += 1
                if failed.unreachable:  # set aside for good: try the others at once, no backoff
                    gone = self.unreachable_error()
                    if gone is not None:
                        gone.request_id = rid
                        raise gone
                    continue
            await asyncio.sleep(self._backoff(attempt, last, failed))
        assert last is not None
        raise RetriesExhaustedError(
            f"gave up after {attempt} attempt(s): {last}", last_error=last, attempts=attempt
        )

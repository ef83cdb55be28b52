"""Same-host transfer: the states stay in the shared arena and the client reads them.

An HTTP body moves every byte through the server's event loop, the kernel's socket
buffers and the client's receive loop: ~1 GB/s per Python process, a quarter of what
one H200 prefills (bench/README.md). A client on the same host can skip that. It asks
for `LEASE_MEDIA_TYPE`; the response is a small safetensors file (token ids, mask,
metadata) whose metadata says where the states lie in the arena; the client reads them
from its own read-only mapping, writes its corpus file from there, then releases the
lease with `DELETE /leases/{id}`.

Safety rests on one rule: a range is reused only after its lease is released or has
expired (`--lease-timeout`). A release answered 204 therefore proves that the bytes the
client read were still its own; 410 means the lease had expired first and the client
must redo the sample. Lease ids are random 128-bit tokens, so one client cannot release
another's range.

The mapping is handed over once per client process on a Unix socket in the abstract
namespace (no file to clean up after a crash; reachable from the same network namespace:
the host, or the pod's containers). The client sends one line, its API key (empty when
the server has none); the server checks it, or, without keys, that the peer runs as the
same user or root, and answers with the arena's id, a session id and a read-only
descriptor of the arena (SCM_RIGHTS). A client that cannot connect (another host or
namespace) gets HTTP bodies.

Sessions: the client keeps that connection open while it runs and sends the session id
with its requests; leases are granted only to requests of a live session (others get
an HTTP body) and belong to it, and when the connection closes (the client exited or
was killed) the socket's thread tells the event loop, which releases them at once
(outcome `client_gone`), so a dead client holds no arena memory and does not delay a
drain. A live client that never releases is bounded too (`Leases.may_lease`): at most
--lease-max-per-session leases per session, and client leases together hold at most
half the arena; beyond, its requests get HTTP bodies, so requests answered with bodies
always find room. A chunked lease stream (window.py) counts as one lease of its whole
window from the moment it is admitted (`Leases.hold`) until its window is freed: its chunk
leases come later, so counting them as they were granted let streams admitted together
overshoot the half. An expired chunk lease ends its stream (serving.py): the request is
aborted and its window and KV blocks freed within the timeout.

Who may lease (the threat model, docs/security.md): the descriptor maps the whole arena,
so a holder can read every client's states in it, not only its own. Without API keys only
the server's user (or root) gets it. With --api-key, only the keys also given in
--lease-api-key get it (and /info's offer); every other key gets HTTP bodies, so teams
sharing a server with their own keys cannot read each other's states.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Container
from dataclasses import dataclass

from hsx.protocol.lease import SendReport
from hsx.wire import boot_id
from hsx_service.engine.arena import Reservation
from hsx_service.core.keys import key_matches

log = logging.getLogger("hsx.lease")

_HANDSHAKE_TIMEOUT = 5.0
_MAX_LINE = 4096


@dataclass
class _Lease:
    reservation: Reservation  # the leased range; freed when the lease ends
    timer: asyncio.TimerHandle | None  # its expiry; none for an HTTP worker's lease
    session: str | None  # the client's arena-socket connection, if it sent one
    on_end: Callable[[str, "SendReport | None"], None] | None = None
    counted: bool = False  # against its session's caps (Leases.may_lease)


# Client leases altogether hold at most this share of the arena; beyond it, HTTP bodies.
# However many sessions lease, requests answered with a body always find room.
CLIENT_ARENA_SHARE = 0.5


class StreamHold:
    """A lease stream's share of its session's caps: one lease and its window's bytes, taken
    when the stream is admitted and given back (once) when its window is freed."""

    def __init__(self, leases: "Leases", session: str, nbytes: int) -> None:
        self._leases, self.session, self.nbytes = leases, session, nbytes
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._leases._uncount(self.session, self.nbytes)


class Leases:
    """Live leases of the event loop's thread: grant, release, expire. Each owns the
    Reservation handed over to it and frees it when it ends.

    `may_lease` bounds what clients hold (an HTTP worker's leases are bodies being sent,
    bounded by --max-inflight): at most `per_session` leases per session and
    CLIENT_ARENA_SHARE of the arena for all of them, so a client that never releases
    cannot starve the requests answered with bodies."""

    def __init__(self, timeout: float, on_end: Callable[[str], None] | None = None, per_session: int = 64,
                 arena_bytes: int | None = None):
        self.timeout = timeout
        self._on_end = on_end  # called with the outcome (see release)
        self._live: dict[str, _Lease] = {}
        self.per_session = per_session
        self.client_bytes_max = None if arena_bytes is None else int(arena_bytes * CLIENT_ARENA_SHARE)
        self._held: dict[str, int] = {}  # client leases per session
        self.client_bytes = 0  # arena bytes under client leases
        self.live_sessions: Container[str] | None = None  # the arena socket's (lifecycle.py)

    def session_alive(self, session: str | None) -> bool:
        """False once a session's connection has closed (its leases were released then; one
        granted later would wait for its expiry)."""
        return session is None or self.live_sessions is None or session in self.live_sessions

    def __len__(self) -> int:
        return len(self._live)

    def may_lease(self, session: str, nbytes: int) -> str | None:
        """None when a client's lease of `nbytes` in `session` fits; else why not (that
        request gets an HTTP body)."""
        if self._held.get(session, 0) >= self.per_session:
            return "session"
        if self.client_bytes_max is not None and self.client_bytes + nbytes > self.client_bytes_max:
            return "arena"
        return None

    def hold(self, session: str, nbytes: int) -> StreamHold:
        """`nbytes` counted against the caps now, as one lease of `session` (a lease stream's
        window, whose chunk leases are granted later: `grant(..., counted=False)`). Ask
        `may_lease` first, in the same step of the event loop, for a true cap."""
        self._count(session, nbytes)
        return StreamHold(self, session, nbytes)

    def _count(self, session: str, nbytes: int) -> None:
        self._held[session] = self._held.get(session, 0) + 1
        self.client_bytes += nbytes

    def _uncount(self, session: str, nbytes: int) -> None:
        self.client_bytes -= nbytes
        left = self._held.pop(session) - 1
        if left:
            self._held[session] = left

    def grant(self, reservation: Reservation, session: str | None = None, expires: bool = True,
              on_end: Callable[[str, SendReport | None], None] | None = None, counted: bool = True) -> str:
        """A new lease on `reservation`. `expires`: after the timeout (a client's); an HTTP
        worker's lasts until released or its session ends. `on_end(outcome, report)` runs
        when it ends. `counted`: False for a chunk lease, whose stream's `hold` counts it."""
        lease_id = secrets.token_hex(16)
        timer = asyncio.get_running_loop().call_later(self.timeout, self.release, lease_id, "expired") if expires else None
        counted = counted and expires and session is not None  # a client's: counted against its caps
        self._live[lease_id] = _Lease(reservation, timer, session, on_end, counted)
        if counted:
            self._count(session, reservation.extent.reserved)
        return lease_id

    def end_session(self, session: str) -> int:
        """The client of `session` is gone: release its leases now. Returns how many."""
        gone = [lid for lid, lease in self._live.items() if lease.session == session]
        for lease_id in gone:
            self.release(lease_id, "client_gone")
        if gone:
            log.info("lease session %s closed: %d leases released", session[:8], len(gone))
        return len(gone)

    def release(self, lease_id: str, outcome: str = "released", detail: SendReport | None = None) -> bool:
        """End a lease; True when it was live (for a client's release: its read was valid).
        `outcome` is what ended it: released (by the client), expired, unsent (the
        response carrying it never left), client_gone or shutdown. `detail`: an HTTP worker's report."""
        lease = self._live.pop(lease_id, None)
        if lease is None:
            return False
        if lease.timer is not None:
            lease.timer.cancel()
        if lease.counted:
            self._uncount(lease.session, lease.reservation.extent.reserved)
        if outcome == "expired":
            log.warning("lease %s expired after %.0fs without a release; its range is reused", lease_id[:8], self.timeout)
        lease.reservation.release()
        if self._on_end is not None:
            self._on_end(outcome)
        if lease.on_end is not None:
            lease.on_end(outcome, detail)
        return True

    def end_all(self) -> None:
        """The drain's cut-off: every live lease ends now, counted as `shutdown` (not as
        expired: no client outlived its --lease-timeout)."""
        ended = [lease_id for lease_id in list(self._live) if self.release(lease_id, "shutdown")]
        if ended:
            log.warning("shutdown: %d leases ended at the drain's cut-off (--shutdown-timeout)", len(ended))


def key_may_lease(key: bytes, keys: list[bytes], lease_keys: list[bytes]) -> bool:
    """With API keys, only those marked for leases (--lease-api-key) may take one."""
    return not keys or (bool(lease_keys) and key_matches(key, lease_keys))


@dataclass(frozen=True)
class LeaseTerms:
    """What one request may get: a lease (else an HTTP body), the lease session it belongs
    to, and whether it is an HTTP worker's (which sends the body itself)."""

    granted: bool
    session: str | None = None
    http_worker: bool = False


NO_LEASE = LeaseTerms(False)


class LeasePolicy:
    """Who may lease, in one place (the threat model in the module docstring): /info's offer
    and each request's terms. The HTTP workers' key always may; otherwise leases must be
    on (--shm-lease) and, with API keys, the key one of --lease-api-key."""

    def __init__(self, shm_lease: bool, keys: list[str], lease_keys: list[str], worker_token: str | None):
        self.shm_lease = shm_lease
        self._keys = [k.encode() for k in keys]
        self._lease_keys = [k.encode() for k in lease_keys]
        self._worker = worker_token.encode() if worker_token is not None else None

    def from_http_worker(self, key: str | None) -> bool:
        return self._worker is not None and key_matches((key or "").encode(), [self._worker])

    def may_lease(self, key: str | None) -> bool:
        if self.from_http_worker(key):
            return True
        if not self.shm_lease:  # the lease table may exist for HTTP workers alone
            return False
        return key_may_lease((key or "").encode(), self._keys, self._lease_keys)

    def terms(self, key: str | None, wants_lease: bool, session: str | None, leases: Leases | None,
              live_sessions: Container[str]) -> LeaseTerms:
        """Only keys that may lease get one, and only inside a live session of the arena
        socket: a request without one (left out, closed or made up) gets an HTTP body (its
        Accept lists that too), so every lease ends with its client's connection and none can
        pin the arena until --lease-timeout. The session's caps are checked once the states'
        size is known (Leases.may_lease)."""
        if leases is None or not wants_lease or not self.may_lease(key):
            return NO_LEASE
        if session is None or session not in live_sessions:
            return NO_LEASE
        return LeaseTerms(True, session, self.from_http_worker(key))


class ArenaSocket:
    """Hands the arena's read-only descriptor to authorised same-host clients and keeps
    each one's connection as its lease session (see the module docstring)."""

    def __init__(self, arena_fd: int, arena_id: str, arena_size: int, api_keys: list[str],
                 lease_keys: list[str] | None = None,
                 on_session_end: Callable[[str], None] | None = None, internal_key: str | None = None,
                 clients: bool = True):
        self.name = f"hsx-lease-{arena_id}"
        self.boot_id = boot_id()  # of this host, for /info's offer
        self._fd = arena_fd
        self._arena_id = arena_id
        self._size = arena_size
        self._keys = [k.encode() for k in api_keys]
        self._lease_keys = [k.encode() for k in (lease_keys or [])]
        # The HTTP workers' key (http_workers.py): they map the arena whatever the client keys say.
        self._internal_key = [internal_key.encode()] if internal_key else []
        self._clients = clients  # False (--shm-lease false): the HTTP workers alone may map the arena
        self._on_session_end = on_session_end  # called in the event loop's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sessions: set[str] = set()  # live ones; read by the event loop
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)  # abstract: no file on disk
        self._sock.listen(64)
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._serve, name="hsx-arena-socket", daemon=True)
        self._closed = False

    @property
    def address(self) -> str:
        return "@" + self.name  # the usual notation of an abstract address

    def start(self) -> "ArenaSocket":
        try:  # the loop to tell of closed sessions (none: a test without one)
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2)

    def _serve(self) -> None:
        self._sock.setblocking(False)
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        try:
            while not self._closed:
                for key, _ in self._selector.select(timeout=0.5):
                    if key.data is None:
                        self._accept()
                    else:
                        self._maybe_closed(key.fileobj, key.data)
        finally:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    key.fileobj.close()
            self._selector.close()

    def _accept(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        try:
            session = self._handshake(conn)
        except OSError as exc:
            log.info("arena handshake failed: %s", exc)
            session = None
        if session is None:
            conn.close()
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ, session)

    def _maybe_closed(self, conn: socket.socket, session: str) -> None:
        try:
            data = conn.recv(_MAX_LINE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:  # a client says nothing after its hello: ignore it
            return
        self._selector.unregister(conn)
        conn.close()
        self.sessions.discard(session)
        if self._on_session_end is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_session_end, session)

    def _allowed(self, conn: socket.socket, key: bytes) -> bool:
        if self._internal_key and key_matches(key, self._internal_key):
            return True
        if not self._clients:
            return False
        if self._keys:
            return key_may_lease(key, self._keys, self._lease_keys)
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return uid in (os.getuid(), 0)

    def _handshake(self, conn: socket.socket) -> str | None:
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        line = b""
        while not line.endswith(b"\n") and len(line) < _MAX_LINE:
            chunk = conn.recv(_MAX_LINE)
            if not chunk:
                return None
            line += chunk
        if not self._allowed(conn, line.strip()):
            reason = ("not allowed: this server offers no leases (--shm-lease false)" if not self._clients
                      else "not allowed: this API key may not take leases (the server's --lease-api-key)" if self._keys
                      else "not allowed: another user")
            conn.sendall(json.dumps({"error": reason}).encode())
            return None
        session = secrets.token_hex(16)
        hello = json.dumps({"arena_id": self._arena_id, "size": self._size, "session": session}).encode()
        # Live before the client hears of it: its first request may name the session at once
        # (added after the reply, such a request could find it unknown and get an HTTP body).
        self.sessions.add(session)
        try:
            socket.send_fds(conn, [hello], [self._fd])
        except OSError:
            self.sessions.discard(session)
            raise
        return session

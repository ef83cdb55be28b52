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
same user or root, and answers with the arena's id and a read-only descriptor of the arena
(SCM_RIGHTS). A client that cannot connect (another host or namespace) gets HTTP bodies.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hsx.wire import boot_id
from hsx_service.arena import Reservation
from hsx_service.auth import key_matches

log = logging.getLogger("hsx.lease")

_HANDSHAKE_TIMEOUT = 5.0
_MAX_LINE = 4096


@dataclass
class _Lease:
    reservation: Reservation  # the leased range; freed when the lease ends
    timer: asyncio.TimerHandle


class Leases:
    """Live leases of the event loop's thread: grant, release, expire. Each owns the
    Reservation handed over to it and frees it when it ends."""

    def __init__(self, timeout: float, on_end: Callable[[str], None] | None = None):
        self.timeout = timeout
        self._on_end = on_end  # called with the outcome: released, expired or unsent
        self._live: dict[str, _Lease] = {}

    def __len__(self) -> int:
        return len(self._live)

    def grant(self, reservation: Reservation) -> str:
        lease_id = secrets.token_hex(16)
        timer = asyncio.get_running_loop().call_later(self.timeout, self.release, lease_id, "expired")
        self._live[lease_id] = _Lease(reservation, timer)
        return lease_id

    def release(self, lease_id: str, outcome: str = "released") -> bool:
        """End a lease; True when it was live (for a client's release: its read was valid).
        `outcome` is what ended it: released (by the client), expired, or unsent (the
        response carrying it never left)."""
        lease = self._live.pop(lease_id, None)
        if lease is None:
            return False
        lease.timer.cancel()
        if outcome == "expired":
            log.warning("lease %s expired after %.0fs without a release; its range is reused", lease_id[:8], self.timeout)
        lease.reservation.release()
        if self._on_end is not None:
            self._on_end(outcome)
        return True

    def end_all(self) -> None:
        for lease_id in list(self._live):
            self.release(lease_id, "expired")


class ArenaSocket:
    """Hands the arena's read-only descriptor to authorised same-host clients."""

    def __init__(self, arena_fd: int, arena_id: str, arena_size: int, api_keys: list[str]):
        self.name = f"hsx-lease-{arena_id}"
        self.boot_id = boot_id()  # of this host, for /info's offer
        self._fd = arena_fd
        self._hello = json.dumps({"arena_id": arena_id, "size": arena_size}).encode()
        self._keys = [k.encode() for k in api_keys]
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)  # abstract: no file on disk
        self._sock.listen(64)
        self._thread = threading.Thread(target=self._serve, name="hsx-arena-socket", daemon=True)
        self._closed = False

    @property
    def address(self) -> str:
        return "@" + self.name  # the usual notation of an abstract address

    def start(self) -> "ArenaSocket":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._handshake(conn)
                except OSError as exc:
                    log.info("arena handshake failed: %s", exc)

    def _allowed(self, conn: socket.socket, key: bytes) -> bool:
        if self._keys:
            return key_matches(key, self._keys)
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return uid in (os.getuid(), 0)

    def _handshake(self, conn: socket.socket) -> None:
        conn.settimeout(_HANDSHAKE_TIMEOUT)
        line = b""
        while not line.endswith(b"\n") and len(line) < _MAX_LINE:
            chunk = conn.recv(_MAX_LINE)
            if not chunk:
                return
            line += chunk
        if not self._allowed(conn, line.strip()):
            conn.sendall(json.dumps({"error": "not allowed: wrong API key or another user"}).encode())
            return
        socket.send_fds(conn, [self._hello], [self._fd])

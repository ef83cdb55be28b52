"""The lease protocol both sides speak (the server's half: service/engine/lease.py).

Same-host transfer, the reading side: map a server's arena read-only. Corpus clients
(hsx_client.api) and the server's own HTTP worker processes (hsx_service.http.workers)
both attach this way, so it lives here, below both sides.

`attach(offer)` takes /info's `shm_lease` block, checks that the server runs on this
host (same kernel boot id), asks the server's abstract Unix socket for the arena's
descriptor (sending the API key, if any) and maps it read-only. Any failure raises
`ShmUnavailable` with the reason; the client then keeps using HTTP bodies.

The socket stays open for the mapping's life: it is the client's lease session. Requests
carry its id (`SESSION_HEADER`), and when the connection closes (the client exited,
crashed or was killed) the server releases that session's leases at once instead of at
their --lease-timeout.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
from dataclasses import dataclass
from typing import Any

from hsx.wire import boot_id

_TIMEOUT = 5.0
SESSION_HEADER = "X-Hsx-Lease-Session"  # a request's lease session: ArenaMap.session
SENT_HEADER = "X-Hsx-Sent"  # an HTTP worker's report on its lease release (SendReport)
EXCHANGE_HEADER = "X-Hsx-Exchange"  # an HTTP worker's id for one forwarded request (DELETE /exchanges/{id} aborts it)


class ShmUnavailable(Exception):
    """This client cannot read that server's arena (another host, namespace, user or key)."""


class ArenaMap:
    """A read-only mapping of one server's arena."""

    def __init__(self, arena_id: str, mm: mmap.mmap, session: str | None = None,
                 sock: socket.socket | None = None):
        self.arena_id = arena_id
        self.session = session  # the server's id of this client's open handshake connection
        self._sock = sock
        self._mm = mm
        self._view = memoryview(mm)

    @property
    def size(self) -> int:
        return len(self._mm)

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > len(self._mm):
            raise ValueError(f"range {offset}+{nbytes} lies outside the {len(self._mm)}-byte arena")
        return self._view[offset : offset + nbytes]

    def close(self) -> None:
        if self._sock is not None:  # ends the lease session: the server releases what is left
            self._sock.close()
            self._sock = None
        try:
            self._view.release()
            self._mm.close()
        except BufferError:  # a sample still holds a view; the mapping goes with the process
            pass


def attach(offer: dict[str, Any] | None, api_key: str | None) -> ArenaMap:
    """Blocking (a few ms): run it in a thread."""
    if not offer:
        raise ShmUnavailable("the server does not offer leases (--shm-lease false)")
    if not hasattr(socket, "recv_fds") or not hasattr(socket, "AF_UNIX"):
        raise ShmUnavailable("this platform cannot receive file descriptors")
    if offer.get("boot_id") != boot_id():
        raise ShmUnavailable("the server runs on another host")
    address = str(offer.get("socket", ""))
    if not address.startswith("@"):
        raise ShmUnavailable(f"unexpected socket address {address!r}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_TIMEOUT)
    try:
        try:
            sock.connect("\0" + address[1:])
        except OSError as exc:  # another network namespace (container) or a stopped server
            raise ShmUnavailable(f"cannot reach {address}: {exc}") from exc
        sock.sendall((api_key or "").encode() + b"\n")
        msg, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
    except OSError as exc:
        sock.close()
        raise ShmUnavailable(f"handshake with {address} failed: {exc}") from exc
    if not fds:
        sock.close()
        try:
            reason = json.loads(msg).get("error", msg.decode(errors="replace"))
        except ValueError:
            reason = msg.decode(errors="replace") or "no descriptor"
        raise ShmUnavailable(f"the server refused: {reason}")
    fd = fds[0]
    try:
        hello = json.loads(msg)
        if hello.get("arena_id") != offer.get("arena_id"):
            raise ShmUnavailable("the arena changed since /info (server restarted?)")
        size = int(hello["size"])
        if os.fstat(fd).st_size < size:
            raise ShmUnavailable("the arena descriptor is smaller than announced")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (ValueError, KeyError, OSError) as exc:
        sock.close()
        raise ShmUnavailable(f"bad handshake: {exc}") from exc
    except ShmUnavailable:
        sock.close()
        raise
    finally:
        os.close(fd)
    session = hello.get("session")
    if session is None:  # a server without lease sessions: nothing to keep open
        sock.close()
        return ArenaMap(hello["arena_id"], mm)
    sock.settimeout(None)
    return ArenaMap(hello["arena_id"], mm, str(session), sock)


@dataclass
class SendReport:
    """What an HTTP worker sent under a lease, reported when it releases it (SENT_HEADER),
    so that the engine process, the one owner of the metrics, records the response."""

    raw: int
    wire: int
    complete: bool
    send_s: float
    work_s: float
    coding: str

    def header(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))

    @classmethod
    def parse(cls, value: str | None) -> "SendReport | None":
        if not value:
            return None
        try:
            d = json.loads(value)
            return cls(int(d["raw"]), int(d["wire"]), bool(d["complete"]), float(d["send_s"]), float(d["work_s"]),
                       str(d["coding"]))
        except (ValueError, KeyError, TypeError):
            return None

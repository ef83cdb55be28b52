"""The synthetic server of the transport study (tools/bench/transport.py): prebuilt
/hidden_states-sized bodies over loopback TCP, so that the client is what is measured.

Blocking sockets, one thread per connection, `sendall` of a prebuilt buffer (the GIL is
released for the whole send): the server spends no Python time per byte. `GET/POST
/body?mb=N&enc=identity|zstd`: identity bodies carry a Content-Length; zstd ones are
chunked with `Content-Encoding: zstd`, as `hsx serve` sends them (one zstd frame, chunks
of the size its compressor steps produce). The payload is bf16 bits of Gaussian noise,
which zstd-1 compresses about as much as real activations (~1.2-1.3x).
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import parse_qs, urlsplit

import numpy as np
import zstandard

PIECE = 4 << 20  # input bytes per compressor step (as service/body/compress.py)


def _payload(nbytes: int) -> bytes:
    """bf16 bits of N(0, 3) noise, a 16 MiB block tiled (zstd-1's window is far smaller)."""
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(8 << 20).astype(np.float32) * 3).view(np.uint32) >> 16
    block = block.astype(np.uint16).tobytes()
    reps = -(-nbytes // len(block))
    return (block * reps)[:nbytes]


def _zstd_chunks(body: bytes) -> list[bytes]:
    c = zstandard.ZstdCompressor(level=1).compressobj()
    out = []
    for i in range(0, len(body), PIECE):
        piece = c.compress(body[i : i + PIECE]) + c.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
        if piece:
            out.append(piece)
    out.append(c.flush())
    return [b"%x\r\n" % len(p) + p + b"\r\n" for p in out if p] + [b"0\r\n\r\n"]


class Bodies:
    def __init__(self, sizes_mb: list[int], encodings: list[str]) -> None:
        self.replies: dict[tuple[int, str], list[bytes]] = {}
        self.wire_bytes: dict[tuple[int, str], int] = {}
        top = _payload(max(sizes_mb) << 20)
        for mb in sizes_mb:
            body = top[: mb << 20]
            if "identity" in encodings:
                head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-safetensors\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body))
                self.replies[(mb, "identity")] = [head, body]
                self.wire_bytes[(mb, "identity")] = len(body)
            if "zstd" in encodings:
                chunks = _zstd_chunks(body)
                head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-safetensors\r\n"
                        b"Content-Encoding: zstd\r\nTransfer-Encoding: chunked\r\n\r\n")
                self.replies[(mb, "zstd")] = [head, b"".join(chunks)]
                self.wire_bytes[(mb, "zstd")] = sum(len(c) for c in chunks)  # framing included


def _recv_request(conn: socket.socket, buf: bytearray) -> bytes | None:
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            n = int(v)
    while len(rest) < n:
        data = conn.recv(max(65536, n - len(rest)))
        if not data:
            return None
        rest += data
    buf[:] = rest[n:]
    return head.split(b"\r\n")[0]


def _handle(conn: socket.socket, bodies: Bodies) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    buf = bytearray()
    try:
        while True:
            line = _recv_request(conn, buf)
            if line is None:
                return
            q = parse_qs(urlsplit(line.split(b" ")[1].decode()).query)
            key = (int(q.get("mb", ["8"])[0]), q.get("enc", ["identity"])[0])
            head, body = bodies.replies[key]
            conn.sendall(head)
            conn.sendall(body)
    except (OSError, KeyError):
        pass
    finally:
        conn.close()


def serve(port: int, sizes_mb: list[int], encodings: list[str], ready) -> None:
    bodies = Bodies(sizes_mb, encodings)
    lsock = socket.create_server(("127.0.0.1", port), backlog=256)
    ready({f"{mb},{enc}": n for (mb, enc), n in bodies.wire_bytes.items()})
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=_handle, args=(conn, bodies), daemon=True).start()

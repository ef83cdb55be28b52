"""The wire format of `POST /hidden_states`: a safetensors file.

Both sides use this module: the server builds the header itself so that the tensor
bytes can go out straight from shared memory (no serialize-into-one-buffer copy);
the client parses the same layout. The layout is plain safetensors, so
`safetensors.safe_open` reads a body saved with `curl --compressed -o x.safetensors`.

Tensors, in this order in the body:
  hidden_states  [T, L, H]  model dtype, layer ids ascending, the id N slice pre-norm
  token_ids      [T]        int64
  loss_mask      [T]        uint8 (0/1), present when known
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsx import dtypes

FORMAT = "hsx-hidden-states/1"
MEDIA_TYPE = "application/x-safetensors"
# Same-host transfer (service/engine/lease.py): the same file without the hidden_states bytes;
# `__metadata__["lease"]` (JSON) says where they lie in the server's shared arena:
# {"id", "arena_id", "offset", "nbytes", "dtype", "shape", "expires_in"}.
LEASE_MEDIA_TYPE = "application/vnd.hsx.lease+safetensors"
# A lease request whose states exceed the server's stream window (chunked, issue 29): the same
# header-only lease body, whose `lease` is {"chunked": true, "arena_id", "dtype", "shape",
# "expires_in"}, then one JSON line per chunk as it lands, in token order:
# {"id", "offset", "nbytes", "tokens": [a, b]} (a lease on tokens [a, b) of hidden_states, released
# as a whole lease is), and last {"end": true} or {"error": "...", "status": 5xx}. `LeaseStreamReader`.
LEASE_STREAM_MEDIA_TYPE = "application/vnd.hsx.lease-stream"


def boot_id() -> str:
    """The running kernel's boot id: equal in every process and container of one host.
    /info's `shm_lease` offer carries the server's; a client with another is elsewhere."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


_HEADER_ALIGN = 8


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors name: BF16, F32, I64, U8 ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = dtypes.BY_ST[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


def encode_header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The safetensors prefix (length + JSON) for tensors laid out in `specs` order."""
    header: dict[str, Any] = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces so the data starts 8-byte aligned, as safetensors itself does.
    raw += b" " * (-(8 + len(raw)) % _HEADER_ALIGN)
    return struct.pack("<Q", len(raw)) + raw


@dataclass
class Decoded:
    """A decoded response: numpy views for ids and mask, torch for the states."""

    hidden_states: Any  # torch.Tensor [T, L, H]
    token_ids: np.ndarray
    loss_mask: np.ndarray | None
    metadata: dict[str, str] = field(default_factory=dict)
    media_mask: np.ndarray | None = None  # 1 on each image token (chats with images)

    @property
    def layer_ids(self) -> list[int]:
        return json.loads(self.metadata["layer_ids"])


class WireFormatError(ValueError):
    """The body is not a well-formed hsx safetensors response."""


def parse_header(body: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """Return (header dict, offset where tensor data starts)."""
    if len(body) < 8:
        raise WireFormatError(f"body of {len(body)} bytes is too short for safetensors")
    (n,) = struct.unpack("<Q", bytes(body[:8]))
    if n > len(body) - 8:
        raise WireFormatError(f"safetensors header of {n} bytes overruns a {len(body)}-byte body")
    try:
        header = json.loads(bytes(body[8 : 8 + n]))
    except ValueError as exc:
        raise WireFormatError(f"safetensors header is not JSON: {exc}") from exc
    return header, 8 + n


def check_body(body: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """Parse the header and check that the body holds exactly the bytes it describes
    (cheap: no tensor is decoded). Returns what `parse_header` does."""
    header, start = parse_header(body)
    expected = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if len(body) - start != expected:
        raise WireFormatError(
            f"body holds {len(body) - start} data bytes, the header describes {expected} (truncated?)"
        )
    return header, start


def lease_of(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The lease description of a `LEASE_MEDIA_TYPE` body."""
    header, _ = parse_header(body)
    try:
        lease = json.loads(header.get("__metadata__", {})["lease"])
        for key in ("id", "arena_id", "offset", "nbytes", "dtype", "shape"):
            lease[key]
    except (KeyError, TypeError, ValueError) as exc:
        raise WireFormatError(f"lease response without a valid lease description: {exc}") from exc
    return lease


def decode(body: bytes | bytearray | memoryview, states: memoryview | None = None) -> Decoded:
    """Decode an (already decompressed) response body. Checks sizes and agreement.

    Zero-copy: the tensors are views of `body` (tens of MB per response; copies here
    were a measurable part of the client's cost). For a lease body, `states` is the
    leased arena range: hidden_states becomes a view of it."""
    import warnings

    import torch

    header, start = check_body(body)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    meta = header.get("__metadata__", {})
    if states is not None:
        lease = lease_of(body)
        entries["hidden_states"] = {"dtype": lease["dtype"], "shape": lease["shape"], "external": states}
    for name in ("hidden_states", "token_ids"):
        if name not in entries:
            raise WireFormatError(f"response lacks the {name!r} tensor")
    tensors = {}
    view = memoryview(body).cast("B")
    for name, e in entries.items():
        dt = dtypes.BY_ST.get(e.get("dtype"))
        if dt is None:
            raise WireFormatError(f"tensor {name!r} has unsupported dtype {e.get('dtype')!r}")
        if "external" in e:
            src = memoryview(e["external"]).cast("B")
            lo, hi = 0, src.nbytes
        else:
            src, lo, hi = view, start + e["data_offsets"][0], start + e["data_offsets"][1]
        shape = tuple(e["shape"])
        if hi - lo != TensorSpec(name, e["dtype"], shape).nbytes:
            raise WireFormatError(f"tensor {name!r}: {hi - lo} bytes for shape {shape}")
        with warnings.catch_warnings():  # read-only bodies are fine: nobody writes into them
            warnings.simplefilter("ignore", UserWarning)
            tdt = getattr(torch, dt.name)
            flat = torch.frombuffer(src[lo:hi], dtype=tdt) if hi > lo else torch.empty(0, dtype=tdt)
        tensors[name] = flat.view(shape)
    hs = tensors["hidden_states"]
    ids = tensors["token_ids"].numpy()
    mask = tensors["loss_mask"].numpy() if "loss_mask" in tensors else None
    if hs.ndim != 3 or hs.shape[0] != ids.shape[0]:
        raise WireFormatError(f"hidden_states {tuple(hs.shape)} does not match {ids.shape[0]} tokens")
    media = tensors["media_mask"].numpy() if "media_mask" in tensors else None
    for name, m in (("loss_mask", mask), ("media_mask", media)):
        if m is not None and m.shape != ids.shape:
            raise WireFormatError(f"{name} {m.shape} does not match token_ids {ids.shape}")
    return Decoded(hidden_states=hs, token_ids=ids, loss_mask=mask, metadata=meta, media_mask=media)


def head_size(prefix: bytes | bytearray | memoryview) -> int | None:
    """The length of a safetensors body (header and data) from its first bytes, or None while
    its header has not fully arrived."""
    if len(prefix) < 8:
        return None
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if len(prefix) < 8 + n:
        return None
    header, start = parse_header(prefix[: 8 + n])
    return start + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)


class LeaseStreamReader:
    """A `LEASE_STREAM_MEDIA_TYPE` body, fed as it arrives: first its head (the lease
    safetensors body), then its records. `feed` returns the records completed by `data`."""

    MAX_LINE = 1 << 16

    def __init__(self) -> None:
        self._buf = bytearray()
        self.head: bytes | None = None
        self.lease: dict[str, Any] | None = None
        self.ended = False

    def feed(self, data: bytes | memoryview) -> list[dict[str, Any]]:
        self._buf += data
        if self.head is None:
            size = head_size(self._buf)
            if size is None or len(self._buf) < size:
                return []
            self.head = bytes(self._buf[:size])
            del self._buf[:size]
            check_body(self.head)
            self.lease = chunked_lease_of(self.head)
        records = []
        while (nl := self._buf.find(b"\n")) >= 0:
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise WireFormatError(f"lease stream record is not JSON: {exc}") from exc
            if not isinstance(rec, dict) or not ("end" in rec or "error" in rec or
                                                 all(k in rec for k in ("id", "offset", "nbytes", "tokens"))):
                raise WireFormatError(f"malformed lease stream record {line[:200]!r}")
            if self.ended:
                raise WireFormatError("lease stream record after its end")
            self.ended = "end" in rec or "error" in rec
            records.append(rec)
        if len(self._buf) > self.MAX_LINE:
            raise WireFormatError("lease stream record too long")
        return records

    def finish(self) -> None:
        """The body ended: it must have said so."""
        if self.head is None or not self.ended or self._buf.strip():
            raise WireFormatError("lease stream ended early (no end record)")


def chunked_lease_of(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The lease description of a `LEASE_STREAM_MEDIA_TYPE` head."""
    header, _ = parse_header(body)
    try:
        lease = json.loads(header.get("__metadata__", {})["lease"])
        if lease.get("chunked") is not True:
            raise ValueError("not chunked")
        for key in ("arena_id", "dtype", "shape"):
            lease[key]
    except (KeyError, TypeError, ValueError) as exc:
        raise WireFormatError(f"lease stream without a valid chunked lease description: {exc}") from exc
    return lease

"""The bf16 exponent-plane codec of `application/vnd.hsx.bf16split+safetensors`.

Why: in bf16 activations the sign and the 7 mantissa bits are noise; only the 8-bit
exponent compresses (~2.6-2.9 bits of entropy). zstd on interleaved bf16 gives ~1.27x;
cutting each piece of the tensor into an exponent plane (zstd level 1 tuned as an
entropy coder) and a sign+mantissa plane (stored) gives ~1.49x at a similar speed
(bench/README.md, DESIGN.md's codec facts).

The body (README, "Wire format"): a zstd stream of standard frames (RFC 8878), one
after the other; decompressed, it is the `application/x-safetensors` body except that
the bytes of `hidden_states` (BF16) are stored piece by piece: each piece of `n`
values (`PIECE` bytes, the last one shorter) as `n` exponent bytes `(v >> 7) & 0xFF`
then `n` sign+mantissa bytes `((v >> 8) & 0x80) | (v & 0x7F)`, `v` the value's
little-endian uint16. `__metadata__["encoding"]` is `bf16split/1` and
`__metadata__["bf16split_piece"]` the piece size in bytes.

Both sides use this module: the server's frames (`encode_piece`), the client's join
(`unsplit`). Every function releases the GIL in its large loops (numpy, zstandard),
so pieces of one body are coded in parallel threads.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

MEDIA_TYPE = "application/vnd.hsx.bf16split+safetensors"
ENCODING = "bf16split/1"
PIECE = 4 << 20  # bytes of bf16 per piece: one task of the server's pool

# zstd level 1 as an entropy coder on the exponent plane: small hash table, long minimum
# match (matches are rare in noise-like exponents; the Huffman stage does the work).
_EXP_PARAMS = zstandard.ZstdCompressionParameters.from_level(1, hash_log=6, min_match=7)
_local = threading.local()  # zstd contexts are not thread-safe: one per thread

_ZSTD_MAGIC = struct.pack("<I", 0xFD2FB528)
_RAW_BLOCK_MAX = 128 << 10  # RFC 8878 §3.1.1.2.4: Block_Maximum_Size


def _exp_compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(compression_params=_EXP_PARAMS)
    return c


def split(piece: memoryview | bytes) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bytes -> (exponent plane, sign+mantissa plane), uint8 each."""
    b = np.frombuffer(piece, dtype=np.uint8)
    if b.size % 2:
        raise ValueError(f"a bf16 piece of {b.size} bytes (odd)")
    lo, hi = b[0::2], b[1::2]
    exp = np.left_shift(hi, 1)  # uint8: the sign bit falls off
    exp |= lo >> 7
    sm = hi & 0x80
    sm |= lo & 0x7F
    return exp, sm


def join(exp: np.ndarray, sm: np.ndarray, out: np.ndarray) -> None:
    """The inverse of `split`, written into `out` (uint8, 2 bytes per value)."""
    lo, hi = out[0::2], out[1::2]
    np.left_shift(exp, 7, out=lo)
    lo |= sm & 0x7F
    np.right_shift(exp, 1, out=hi)
    hi |= sm & 0x80


def raw_frame(data: memoryview | bytes | np.ndarray) -> bytes:
    """A standard zstd frame that stores `data` as it is (raw blocks): any zstd decoder
    reads it, at memcpy speed, and nothing is spent on compressing noise."""
    view = memoryview(data).cast("B")
    n = len(view)
    # Frame_Header_Descriptor: FCS 4 bytes (flag 2), single segment, no checksum, no dict.
    parts = [_ZSTD_MAGIC, bytes([0xA0]), struct.pack("<I", n)]
    if n == 0:
        parts.append((1).to_bytes(3, "little"))  # one empty last raw block
    for i in range(0, n, _RAW_BLOCK_MAX):
        size = min(_RAW_BLOCK_MAX, n - i)
        last = 1 if i + size >= n else 0
        parts.append((last | (size << 3)).to_bytes(3, "little"))  # Block_Type 0 = raw
        parts.append(view[i : i + size])
    return b"".join(parts)


def encode_piece(piece: memoryview) -> bytes:
    """One piece of the hidden_states bytes -> its two frames (exponents coded, the rest raw)."""
    exp, sm = split(piece)
    return _exp_compressor().compress(exp.data) + raw_frame(sm)


def unsplit(src: bytes | memoryview, dst: bytearray | memoryview, nbytes: int, piece: int = PIECE) -> None:
    """The planar hidden_states bytes `src[:nbytes]` back to bf16, into `dst[:nbytes]`."""
    if piece <= 0 or piece % 2:
        raise ValueError(f"bf16split piece of {piece} bytes (must be even and positive)")
    a = np.frombuffer(src, dtype=np.uint8, count=nbytes)
    out = np.frombuffer(dst, dtype=np.uint8, count=nbytes)
    for i in range(0, nbytes, piece):
        seg = a[i : i + piece]
        half = len(seg) // 2
        join(seg[:half], seg[half:], out[i : i + len(seg)])


def decode_body(raw: bytes | memoryview) -> bytearray:
    """A whole bf16split body (the zstd stream) -> the `application/x-safetensors` body
    it stands for, bit-exact: header without the layout keys, states joined."""
    from hsx import wire

    plain = zstandard.ZstdDecompressor().decompressobj(write_size=4 << 20, read_across_frames=True).decompress(raw)
    header, start = wire.check_body(plain)
    meta = dict(header.get("__metadata__", {}))
    if meta.pop("encoding", None) != ENCODING:
        raise wire.WireFormatError(f"a {MEDIA_TYPE} body whose metadata lacks encoding {ENCODING!r}")
    piece = int(meta.pop("bf16split_piece", 0) or 0)
    specs = [wire.TensorSpec(k, v["dtype"], tuple(v["shape"]))
             for k, v in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                                key=lambda kv: kv[1]["data_offsets"][0])]
    states = header.get("hidden_states") or {}
    if states.get("dtype") != "BF16":
        raise wire.WireFormatError(f"a {MEDIA_TYPE} body whose states are {states.get('dtype')!r}, not BF16")
    head = wire.encode_header(specs, meta)
    out = bytearray(len(head) + len(plain) - start)
    out[: len(head)] = head
    src, dst = memoryview(plain)[start:], memoryview(out)[len(head):]
    lo, hi = states["data_offsets"]
    dst[:lo] = src[:lo]
    unsplit(src[lo:hi], dst[lo:hi], hi - lo, piece)
    dst[hi:] = src[hi:]
    return out

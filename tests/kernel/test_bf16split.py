"""The bf16split media type: the codec (hsx/bf16split.py), the server's parallel stream
(service/body/compress.py) and the client's decode (client/api.py), bit-exact, on real
activations (stories260K through transformers), random bf16 and edge values; plus the
negotiation and the pool's bounds. No engine: these run in the fast tier."""

from __future__ import annotations

import asyncio
import functools
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
import zstandard

from _server import STORIES
from hsx import bf16split
from hsx.wire import TensorSpec, decode, encode_header
from hsx_client.responses import finish_body as _finish_body
from hsx_service.body.compress import CompressPool, _in_order, stream_bf16split
from hsx_service.body.response import Body, Stats, stream_zstd


def _u16(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int16).numpy().tobytes()


EDGES = torch.tensor(
    [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 3.0e38, -3.0e38,
     1e-40, -1e-40, 9.2e-41, 1.18e-38, -1.18e-38, 65504.0, 2.0 ** -133], dtype=torch.bfloat16,
)


def _all_bit_patterns() -> bytes:
    return np.arange(1 << 16, dtype=np.uint16).tobytes()  # every bf16 value, NaN payloads included


@pytest.mark.parametrize("data", [_all_bit_patterns(), _u16(EDGES), b"", _u16(torch.randn(999).bfloat16())],
                         ids=["every-pattern", "edges", "empty", "odd-count"])
def test_split_join_is_exact(data):
    exp, sm = bf16split.split(data)
    out = np.empty(len(data), dtype=np.uint8)
    bf16split.join(exp, sm, out)
    assert out.tobytes() == data


def test_exponent_plane_is_the_exponent():
    v = np.frombuffer(_u16(EDGES), dtype=np.uint16)
    exp, sm = bf16split.split(v.tobytes())
    assert exp.tolist() == ((v >> 7) & 0xFF).astype(np.uint8).tolist()
    assert sm.tolist() == (((v >> 8) & 0x80) | (v & 0x7F)).astype(np.uint8).tolist()


@pytest.mark.parametrize("n", [0, 1, 1000, 128 << 10, (128 << 10) + 1, 1 << 20])
def test_raw_frame_is_standard_zstd(n, tmp_path):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    frame = bf16split.raw_frame(data)
    assert zstandard.ZstdDecompressor().decompress(frame) == data
    both = frame + zstandard.ZstdCompressor().compress(b"tail")
    assert zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(both) == data + b"tail"
    if shutil.which("zstd"):  # the reference implementation's command line
        (tmp_path / "f.zst").write_bytes(both)
        out = subprocess.run(["zstd", "-dc", str(tmp_path / "f.zst")], capture_output=True, check=True).stdout
        assert out == data + b"tail"


def test_odd_piece_is_refused():
    with pytest.raises(ValueError, match="odd"):
        bf16split.split(b"abc")
    with pytest.raises(ValueError, match="even"):
        bf16split.unsplit(bytes(4), bytearray(4), 4, piece=3)


# --------------------------------------------------------------- server stream -> client decode

def _body(states: torch.Tensor, mask: bool = True):
    t, l, h = states.shape
    ids = np.arange(t, dtype=np.int64)
    specs = [TensorSpec("hidden_states", "BF16", (t, l, h)), TensorSpec("token_ids", "I64", (t,))]
    parts: list = [memoryview(bytearray(_u16(states))), ids.tobytes()]
    if mask:
        specs.append(TensorSpec("loss_mask", "U8", (t,)))
        parts.append((ids % 2).astype(np.uint8).tobytes())
    meta = {"format": "hsx-hidden-states/1", "layer_ids": "[1, 2]"}
    plain = encode_header(specs, meta) + b"".join(bytes(p) for p in parts)
    return specs, meta, parts, plain


async def _collect(stream) -> bytes:
    return b"".join([bytes(c) async for c in stream])


def _serve_bf16split(states: torch.Tensor, pool: CompressPool, mask: bool = True):
    specs, meta, parts, plain = _body(states, mask)
    stats = Stats()
    wire_bytes = asyncio.run(_collect(stream_bf16split(specs, meta, parts, stats, pool)))
    assert stats.complete and stats.wire == len(wire_bytes)
    return wire_bytes, plain


@functools.lru_cache(maxsize=1)
def _stories_states() -> torch.Tensor:
    if not (STORIES / "config.json").exists():
        pytest.skip(f"shared fixture {STORIES} absent")
    from _reference import reference_states

    import json

    from transformers import AutoTokenizer

    from _server import CHAT

    tok = AutoTokenizer.from_pretrained(str(STORIES))
    threads = [json.loads(line) for line in (CHAT / "oasst" / "threads.messages.jsonl").open()][:4]
    text = " ".join(m["content"] for t in threads for m in t["messages"])
    ids = tok(text)["input_ids"][:400]  # real text through the trained model
    return reference_states(str(STORIES), ids, [1, 3, 5]).to(torch.bfloat16)


@pytest.fixture(scope="module")
def pool():
    p = CompressPool(threads=2, inflight=3, window=2)
    yield p
    p.shutdown()


@pytest.mark.parametrize("kind", ["stories260K", "random", "edges", "large"])
def test_bf16split_body_decodes_bit_exact(kind, pool):
    if kind == "stories260K":
        states = _stories_states()
    elif kind == "random":
        states = (torch.randn(64, 3, 256) * 4).bfloat16()
    elif kind == "edges":
        states = EDGES.repeat(5, 2, 1)
    else:  # several 4 MiB pieces and a short last one
        states = (torch.randn(3000, 2, 1024) * 0.3).bfloat16()
    wire_bytes, plain = _serve_bf16split(states, pool)
    body = _finish_body(wire_bytes, "bf16split")
    assert bytes(body) == plain
    dec = decode(body)
    assert torch.equal(dec.hidden_states.view(torch.int16), states.view(torch.int16))
    # a third party: any zstd decoder, then the layout the README describes
    raw = zstandard.ZstdDecompressor().decompressobj(read_across_frames=True).decompress(wire_bytes)
    assert _third_party_decode(raw) == dec.hidden_states.view(torch.int16).numpy().tobytes()


def _third_party_decode(raw: bytes) -> bytes:
    """The README's description of the layout, followed literally (no hsx code)."""
    import json
    import struct

    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    piece = int(header["__metadata__"]["bf16split_piece"])
    lo, hi = header["hidden_states"]["data_offsets"]
    data = np.frombuffer(raw, dtype=np.uint8, offset=8 + n + lo, count=hi - lo)
    out = []
    for i in range(0, len(data), piece):
        seg = data[i : i + piece]
        exp, sm = seg[: len(seg) // 2].astype(np.uint16), seg[len(seg) // 2 :].astype(np.uint16)
        out.append((((sm & 0x80) << 8) | (exp << 7) | (sm & 0x7F)).astype("<u2").tobytes())
    return b"".join(out)


def test_bf16split_ratio_beats_zstd_on_real_states(pool):
    states = _stories_states()
    wire_bytes, plain = _serve_bf16split(states, pool, mask=False)
    z = zstandard.ZstdCompressor(level=1).compress(plain)
    assert len(wire_bytes) < len(z), (len(plain) / len(wire_bytes), len(plain) / len(z))


def test_bf16split_decode_refuses_a_body_without_its_encoding():
    plain = _body(torch.zeros(2, 1, 4).bfloat16())[3]
    with pytest.raises(ValueError, match="encoding"):
        bf16split.decode_body(zstandard.ZstdCompressor().compress(plain))


def test_zstd_stream_is_one_frame_on_the_pool(pool):
    """httpx decodes one frame only reliably: Content-Encoding zstd stays one frame."""
    states = (torch.randn(3000, 2, 1024) * 0.3).bfloat16()
    _, _, parts, plain = _body(states)
    body = Body([plain])
    stats = Stats()
    out = asyncio.run(_collect(stream_zstd(body, stats, 1, pool.executor)))
    assert zstandard.ZstdDecompressor().decompress(out) == plain
    assert zstandard.get_frame_parameters(out).content_size == len(plain)
    import httpx._decoders as dec

    d = dec.ZStandardDecoder()
    got = b"".join(d.decode(out[i : i + 65536]) for i in range(0, len(out), 65536)) + d.flush()
    assert got == plain


# --------------------------------------------------------------- the pool's bounds

def test_pool_bounds_pieces_in_flight_across_bodies():
    pool = CompressPool(threads=4, inflight=3, window=2)
    live, peak, lock = [0], [0], threading.Lock()

    def work(view: memoryview) -> bytes:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.01)
        with lock:
            live[0] -= 1
        return bytes(view)

    async def main():
        bodies = [[(memoryview(bytes([i]) * 10), work) for _ in range(8)] for i in range(3)]
        outs = await asyncio.gather(*(_collect(_in_order(b, Stats(), pool)) for b in bodies))
        return outs

    outs = asyncio.run(main())
    pool.shutdown()
    assert outs == [bytes([i]) * 80 for i in range(3)]  # in order, each body whole
    assert peak[0] <= 3


def test_closed_stream_waits_for_its_pieces():
    """Once aclose() returns, no piece reads the (arena) memory any more."""
    pool = CompressPool(threads=2, inflight=4, window=4)
    running = [0]

    def slow(view: memoryview) -> bytes:
        running[0] += 1
        time.sleep(0.05)
        running[0] -= 1
        return bytes(view)

    async def main():
        stream = _in_order([(memoryview(b"x"), slow) for _ in range(8)], Stats(), pool)
        await stream.__anext__()
        await stream.aclose()
        return running[0]

    assert asyncio.run(main()) == 0
    pool.shutdown()

"""`hsx extract --dtype fp8` samples written as their states arrive (issue 36.8): the whole
path's bytes for the same states (per-token scales: each chunk quantizes alone), no file
under its final name when a chunk is refused or the stream breaks, and the client's memory
bounded by its chunks, not the sample (bench/fp8_stream_memory.py, in processes of its own)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx import wire
from hsx_client.corpus import store
from hsx_client.corpus.formats import CorpusContext, CorpusFormatError, get_format
from hsx_client.corpus.formats import speculators_variants
from hsx_client.corpus.stream_write import store_stream
from hsx_client.body_parser import BodyParser
from _corpus_helpers import HIDDEN, LAYER_IDS, VOCAB, DecodedStream, make_decoded, store_files

REPO = Path(__file__).resolve().parents[3]


def ctx_of(dtype: str = "bfloat16") -> CorpusContext:
    return CorpusContext(layer_ids=list(LAYER_IDS), hidden_size=HIDDEN, dtype=dtype, final_norm=None,
                         draft_vocab_size=None, vocab_size=VOCAB)


class BodyStream:
    """The HTTP stream's parser over a body in pieces (no socket): chunks of whole tokens
    at most `chunk_bytes`."""

    def __init__(self, body: bytes, chunk_bytes: int, piece: int = 777):
        self.pieces = [body[i:i + piece] for i in range(0, len(body), piece)]
        self.parser = BodyParser(chunk_bytes)
        self._head = None

    async def layout(self):
        i = 0
        while self.parser.layout is None:
            self.rest = self.parser.feed_header(memoryview(self.pieces[i]))
            i += 1
        self.pieces = self.pieces[i:]
        return self.parser.layout

    async def chunks(self):
        for c in self.parser.feed(self.rest):
            yield c
        for p in self.pieces:
            for c in self.parser.feed(p):
                yield c
        self._head = self.parser.finish()

    async def head(self):
        return self._head


def body_of(d: wire.Decoded) -> bytes:
    from hsx import dtypes

    hs, ids = d.hidden_states, d.token_ids
    specs = [wire.TensorSpec("hidden_states", dtypes.st_code(hs.dtype), tuple(hs.shape)),
             wire.TensorSpec("token_ids", "I64", ids.shape), wire.TensorSpec("loss_mask", "U8", d.loss_mask.shape)]
    parts = [hs.view(torch.uint8).numpy().tobytes(), ids.tobytes(), np.asarray(d.loss_mask, np.uint8).tobytes()]
    return wire.encode_header(specs, d.metadata) + b"".join(parts)


async def blocking(fn, *args):
    return await asyncio.to_thread(fn, *args)


def stream_write(out, stream, ctx, index=3):
    return asyncio.run(store_stream(out, get_format("speculators", dtype="fp8"), index, stream, ctx, blocking))


def whole_file(tmp_path, d, ctx, index=3):
    fmt = get_format("speculators", dtype="fp8")
    want = fmt.encode_sample(index, d, ctx)
    info = store.write_files_atomic(tmp_path / "w", want.files)
    return want, info, (tmp_path / "w" / fmt.hs_path(index)).read_bytes()


def test_the_fp8_format_streams():
    """The run loop gives a format streams only when it says so: fp8 took whole samples."""
    assert get_format("speculators", dtype="fp8").streams is True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,slice_bytes", [(1, None), (5, None), (61, None), (61, 3000), (13, 1)])
def test_streamed_fp8_file_is_the_whole_paths_bytes(tmp_path, monkeypatch, dtype, rows, slice_bytes):
    """Chunks of any size, and slices within a chunk (slice_bytes: a whole sample handed
    over as one chunk is quantized piece by piece), give encode_sample's file byte for byte."""
    if slice_bytes is not None:
        monkeypatch.setattr(speculators_variants, "QUANT_SLICE_BYTES", slice_bytes)
    ctx = ctx_of(str(dtype).removeprefix("torch."))
    d = make_decoded(11, 61, dtype=dtype)
    d.hidden_states[7] = 0  # an all-zero token: the scale's floor
    d.hidden_states[9] *= 300  # tokens of very different ranges: each its own scale
    got = stream_write(tmp_path / "s", DecodedStream(d, rows=rows), ctx)
    want, info, want_bytes = whole_file(tmp_path, d, ctx)
    fmt = get_format("speculators", dtype="fp8")
    assert (tmp_path / "s" / fmt.hs_path(3)).read_bytes() == want_bytes
    assert got.files == info and got.record == want.record
    assert store.check_checksums(tmp_path / "s", {"files": got.files}) == []
    assert fmt.verify_sample(tmp_path / "s", 3, got.record) == []


def test_streamed_fp8_over_an_http_body_is_the_whole_paths_bytes(tmp_path):
    ctx = ctx_of()
    d = make_decoded(12, 200)
    row = 4 * HIDDEN * 2
    got = stream_write(tmp_path / "s", BodyStream(body_of(d), chunk_bytes=7 * row + 5), ctx)  # 29 chunks
    want, info, want_bytes = whole_file(tmp_path, d, ctx)
    assert (tmp_path / "s" / get_format("speculators", dtype="fp8").hs_path(3)).read_bytes() == want_bytes
    assert got.files == info and got.record == want.record


@pytest.mark.slow  # datasets and speculators' imports: seconds
def test_the_readers_get_the_whole_paths_states(tmp_path):
    """speculators' fp8 backend (hs_connectors' FP8Transfer) reads a streamed corpus as the
    whole path's: the same rows, the same dequantized states."""
    pytest.importorskip("speculators", reason="speculators 0.9 is not installed (scripts/install.sh --test)")
    pytest.importorskip("hs_connectors", reason="hs-connectors 0.9 is not installed (scripts/install.sh --test)")
    from hs_connectors import FP8Transfer
    from speculators.train.data import ArrowDataset

    ctx = ctx_of()
    fmt = get_format("speculators", dtype="fp8")
    decoded = {i: make_decoded(300 + i, t) for i, t in enumerate([40, 9, 77])}
    rows = {}
    for root, streamed in (("s", True), ("w", False)):
        records = []
        for i, d in decoded.items():
            if streamed:
                records.append((i, stream_write(tmp_path / root, DecodedStream(d, rows=4), ctx, index=i).record))
            else:
                out = fmt.encode_sample(i, d, ctx)
                store_files(tmp_path / root, out.files)
                records.append((i, out.record))
        fmt.finalize(tmp_path / root, records, ctx)
        ds = ArrowDataset(512, str(tmp_path / root), transfer=FP8Transfer(tmp_path / root / "hidden_states"),
                          on_missing="raise", train_ratio=1.0)
        rows[root] = [ds[i] for i in range(len(ds))]
    assert len(rows["s"]) == len(rows["w"]) == len(decoded)
    for a, b in zip(rows["s"], rows["w"]):
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


@pytest.mark.parametrize("bad_token", [3, 58])
def test_non_finite_states_in_any_chunk_are_refused_and_leave_no_file(tmp_path, bad_token):
    d = make_decoded(13, 61)
    d.hidden_states[bad_token, 2, 1] = float("nan")
    with pytest.raises(CorpusFormatError, match="NaN or infinity"):
        stream_write(tmp_path, DecodedStream(d, rows=4), ctx_of())
    assert not any(p.is_file() for p in tmp_path.rglob("*")), list(tmp_path.rglob("*"))


@pytest.mark.parametrize("fail_at", [0, 3])
def test_a_cut_stream_leaves_no_file(tmp_path, fail_at):
    with pytest.raises(ConnectionError):
        stream_write(tmp_path, DecodedStream(make_decoded(14, 30), rows=4, fail_at=fail_at), ctx_of())
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_a_refused_layout_writes_nothing(tmp_path):
    d = make_decoded(15, 9, layer_ids=[1, 2, 4])
    with pytest.raises(CorpusFormatError, match="4 layers"):
        stream_write(tmp_path, DecodedStream(d), ctx_of())
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def _bench(tmp_path, arms: str, tokens: int, hidden: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(REPO / "bench" / "fp8_stream_memory.py"), "--arms", arms, "--tokens",
                        str(tokens), "--hidden", str(hidden), "--dir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return {x["arm"]: x for x in json.loads(r.stdout)}


@pytest.mark.slow
def test_memory_is_a_few_chunks_however_long_the_sample(tmp_path):
    """A 128 MiB bf16 sample in 4 MiB chunks: the streamed fp8 store grows the client's RSS
    by a few chunks (its float32 slices, the allocator's and torch's threads' slack; the same
    at 512 MiB: bench/README.md); the whole-sample path it replaces held several samples."""
    tokens, hidden = 4096, 4096
    sample_mib = tokens * 4 * hidden * 2 / 2**20
    got = _bench(tmp_path, "fp8-stream,fp8-whole", tokens, hidden)
    stream, whole = got["fp8-stream"], got["fp8-whole"]
    print(f"fp8, {sample_mib:.0f} MiB sample: streamed +{stream['growth_mib']:.0f} MiB, "
          f"whole +{whole['growth_mib']:.0f} MiB")
    assert stream["written_mib"] == whole["written_mib"]
    assert stream["growth_mib"] < 12 * stream["chunk_mib"] < sample_mib / 2, stream
    assert whole["growth_mib"] > 2 * sample_mib, whole  # what the comparison guards

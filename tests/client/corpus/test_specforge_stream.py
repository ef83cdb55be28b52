"""SpecForge files written as the states arrive (issue 29): a torch.save archive written front
to back (hsx_client.corpus.torch_zip) that torch.load and SpecForge's own reader take as the
whole path's file, no file under its final name when the stream breaks, and memory bounded
by a few chunks however long the sample."""

from __future__ import annotations

import asyncio
import io
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch

from hsx_client.corpus import store
from hsx_client.corpus.formats import CorpusContext, get_format
from hsx_client.corpus.formats.specforge import SpecForgeFormat
from hsx_client.corpus.stream_write import store_stream
from hsx_client.corpus.torch_zip import ALIGN, StorageRef, TensorRef, TorchZipWriter, pickle_object
from hsx_client.postnorm import FinalNorm
from hsx_client.sample_stream import SampleHead, StatesChunk, StatesLayout
from _corpus_helpers import HIDDEN, LAYER_IDS, VOCAB, DecodedStream, make_decoded, specforge_batches, store_files

KEYS = ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state")


def ctx_of(dtype: str = "bfloat16", hidden: int = HIDDEN) -> CorpusContext:
    w = np.linspace(0.5, 1.5, hidden, dtype=np.float32)
    return CorpusContext(layer_ids=list(LAYER_IDS), hidden_size=hidden, dtype=dtype,
                         final_norm=FinalNorm(weight=w, eps=1e-5), draft_vocab_size=None, vocab_size=VOCAB)


async def blocking(fn, *args):
    return await asyncio.to_thread(fn, *args)


def stream_write(out, d, ctx, index=3, **kw):
    return asyncio.run(store_stream(out, SpecForgeFormat(), index, DecodedStream(d, **kw), ctx, blocking))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mmap", [True, False])
def test_streamed_ckpt_loads_as_the_whole_paths(tmp_path, dtype, mmap):
    ctx = ctx_of(str(dtype).removeprefix("torch."))
    d = make_decoded(7, 61, dtype=dtype)
    got = stream_write(tmp_path / "s", d, ctx)
    fmt = SpecForgeFormat()
    want = fmt.encode_sample(3, d, ctx)
    rel = fmt.ckpt_path(3)
    store_files(tmp_path / "w", want.files)
    a = torch.load(tmp_path / "s" / rel, weights_only=True, mmap=mmap)
    b = torch.load(tmp_path / "w" / rel, weights_only=True, mmap=mmap)
    assert set(a) == set(b) == set(KEYS)
    for k in KEYS:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k
    assert got.record == want.record
    assert store.check_checksums(tmp_path / "s", {"files": got.files}) == []
    assert fmt.verify_sample(tmp_path / "s", 3, got.record) == []
    # every record's data where torch aligns it (mmap maps storages in place)
    reader = torch._C.PyTorchFileReader(str(tmp_path / "s" / rel))
    for name in reader.get_all_records():
        assert reader.get_record_offset(name) % ALIGN == 0, name
    assert zipfile.ZipFile(tmp_path / "s" / rel).testzip() is None  # CRCs and sizes as any unzip checks


def test_the_pickle_is_torchs_own():
    """data.pkl byte for byte what torch.save writes for the same views of one storage."""
    t, h = 6, 4
    rows = torch.zeros(t, 4 * h, dtype=torch.bfloat16)
    ids, mask = torch.zeros(t, dtype=torch.int64), torch.zeros(t, dtype=torch.int64)
    buf = io.BytesIO()
    torch.save({"input_ids": ids, "loss_mask": mask, "aux_hidden_state": rows[:, :3 * h].unsqueeze(0),
                "hidden_state": rows[:, 3 * h:].unsqueeze(0)}, buf)
    theirs = zipfile.ZipFile(buf).read("archive/data.pkl")
    states = StorageRef("2", torch.bfloat16, t * 4 * h)
    ours = pickle_object({
        "input_ids": TensorRef(StorageRef("0", torch.int64, t), 0, (t,), (1,)),
        "loss_mask": TensorRef(StorageRef("1", torch.int64, t), 0, (t,), (1,)),
        "aux_hidden_state": TensorRef(states, 0, (1, t, 3 * h), (t * 4 * h, 4 * h, 1)),
        "hidden_state": TensorRef(states, 3 * h, (1, t, h), (t * 4 * h, 4 * h, 1)),
    })
    assert ours == theirs


def local_extra_ids(path, info: zipfile.ZipInfo) -> list[int]:
    """The ids of the extra fields in a record's local header."""
    raw = path.read_bytes()
    o = info.header_offset
    name_len, extra_len = struct.unpack_from("<HH", raw, o + 26)
    extra, ids = raw[o + 30 + name_len:o + 30 + name_len + extra_len], []
    while extra:
        fid, n = struct.unpack_from("<HH", extra)
        ids.append(fid)
        extra = extra[4 + n:]
    return ids


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("how", ["forced", "past_the_limit"])
def test_zip64_records_load(tmp_path, monkeypatch, mmap, how):
    """The zip64 path a storage past 4 GiB takes, on a small archive: forced, or with
    zipfile's 4 GiB limit lowered below the storage (then the central directory and its end
    record are zip64 too, as a sample of > 4 GiB makes them)."""
    if how == "past_the_limit":
        monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 1000)
    x = torch.arange(1000, dtype=torch.float32)
    s = StorageRef("0", torch.float32, 1000)
    path = tmp_path / "z.pt"
    with open(path, "wb") as f:
        w = TorchZipWriter(f.write, force_zip64=how == "forced")
        w.begin(pickle_object({"x": TensorRef(s, 10, (2, 5), (100, 1))}))
        rec = w.open_record("data/0", s.nbytes)
        for part in x.split(333):
            rec.write(part.numpy().data)
        rec.close()
        w.close()
    info = zipfile.ZipFile(path).getinfo("archive/data/0")
    assert 1 in local_extra_ids(path, info)  # the zip64 field
    if how == "past_the_limit":
        assert b"PK\x06\x06" in path.read_bytes()  # the zip64 end of central directory
    got = torch.load(path, weights_only=True, mmap=mmap)["x"]
    assert torch.equal(got, x.as_strided((2, 5), (100, 1), 10))


def test_specforge_reader_gives_the_whole_paths_batches(tmp_path):
    pytest.importorskip("specforge", reason="specforge 0.2.0 not installed")
    ctx = ctx_of()
    fmt = get_format("specforge")
    lengths = {0: 40, 1: 17, 2: 90}
    for root, streamed in (("s", True), ("w", False)):
        records = []
        for i, t in lengths.items():
            d = make_decoded(100 + i, t)
            if streamed:
                records.append((i, stream_write(tmp_path / root, d, ctx, index=i, rows=7).record))
            else:
                out = fmt.encode_sample(i, d, ctx)
                store_files(tmp_path / root, out.files)
                records.append((i, out.record))
        fmt.finalize(tmp_path / root, records, ctx)
    got = {p.rsplit("/", 1)[-1]: b for p, b in specforge_batches(tmp_path / "s", 128)}
    want = {p.rsplit("/", 1)[-1]: b for p, b in specforge_batches(tmp_path / "w", 128)}
    assert set(got) == set(want) == {f"data_{i}.ckpt" for i in lengths}
    for name, b in want.items():
        assert set(got[name]) == set(b)
        for k, v in b.items():
            assert torch.equal(got[name][k], v), (name, k)


@pytest.mark.parametrize("fail_at", [0, 1, 4])
def test_a_cut_stream_leaves_no_file(tmp_path, fail_at):
    with pytest.raises(ConnectionError):
        stream_write(tmp_path, make_decoded(2, 30), ctx_of(), rows=4, fail_at=fail_at)
    assert not any(p.is_file() for p in tmp_path.rglob("*")), list(tmp_path.rglob("*"))


def test_bad_token_ids_after_the_states_leave_no_file(tmp_path):
    d = make_decoded(2, 30)
    d.token_ids[5] = VOCAB + 1  # the head's check fails once every state is written
    with pytest.raises(ValueError, match="outside the target vocab"):
        stream_write(tmp_path, d, ctx_of())
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


class SyntheticStream:
    """A long sample made chunk by chunk (one reused buffer), never whole."""

    def __init__(self, tokens: int, hidden: int, rows: int):
        self.tokens, self.hidden, self.rows = tokens, hidden, rows
        self.buf = np.random.default_rng(0).standard_normal(rows * 4 * hidden).astype(np.float32)
        self.meta = {"layer_ids": "[1, 2, 3, 5]"}

    async def layout(self):
        return StatesLayout(torch.float32, (self.tokens, 4, self.hidden), self.meta)

    async def head(self):
        ids = np.arange(self.tokens, dtype=np.int64) % VOCAB
        return SampleHead(ids, np.ones(self.tokens, np.uint8), self.meta, torch.float32, (self.tokens, 4, self.hidden))

    async def chunks(self):
        for start in range(0, self.tokens, self.rows):
            stop = min(self.tokens, start + self.rows)
            yield StatesChunk(start, stop, self.buf.data.cast("B")[: (stop - start) * 4 * self.hidden * 4])


def test_memory_is_a_few_chunks_however_long_the_sample(tmp_path):
    hidden, rows, tokens = 256, 64, 64 * 200  # 256 KiB chunks, a 50 MiB sample
    chunk = rows * 4 * hidden * 4
    ctx = ctx_of("float32", hidden)
    stream = SyntheticStream(tokens, hidden, rows)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        stored = asyncio.run(store_stream(tmp_path, SpecForgeFormat(), 0, stream, ctx, blocking))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = stored.files[SpecForgeFormat.ckpt_path(0)]["size"]
    assert size > tokens * 4 * hidden * 4 == 200 * chunk
    assert peak < 8 * chunk, f"peak {peak} B traced, chunks of {chunk} B"
    x = torch.load(tmp_path / SpecForgeFormat.ckpt_path(0), weights_only=True, mmap=True)
    assert x["hidden_state"].shape == (1, tokens, hidden)
    assert torch.equal(x["aux_hidden_state"][0, -1], torch.from_numpy(stream.buf[-4 * hidden:-hidden]))

"""A sample written as its states arrive (hsx_client.corpus.stream_write, store.StreamedFile):
the same file and checksum as the whole-sample path, no file under its final name when the
stream breaks, is refused or is dropped; the byte budget's admission."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from hsx import wire
from hsx_client.byte_budget import ByteBudget, stream_chunk_bytes
from hsx_client.corpus import store
from hsx_client.corpus.formats import CorpusContext, CorpusFormatError, SpeculatorsFormat
from hsx_client.corpus.stream_write import StreamDropped, store_stream
from hsx_client.body_parser import BodyParser
from _corpus_helpers import HIDDEN, LAYER_IDS, VOCAB, make_decoded

CTX = CorpusContext(layer_ids=LAYER_IDS, hidden_size=HIDDEN, dtype="bfloat16", final_norm=None,
                    draft_vocab_size=None, vocab_size=VOCAB)


def body_of(d: wire.Decoded) -> bytes:
    hs, ids = d.hidden_states, d.token_ids
    specs = [wire.TensorSpec("hidden_states", "BF16", tuple(hs.shape)), wire.TensorSpec("token_ids", "I64", ids.shape)]
    parts = [hs.view(torch.uint8).numpy().tobytes(), ids.tobytes()]
    if d.loss_mask is not None:
        specs.append(wire.TensorSpec("loss_mask", "U8", d.loss_mask.shape))
        parts.append(np.asarray(d.loss_mask, dtype=np.uint8).tobytes())
    return wire.encode_header(specs, d.metadata) + b"".join(parts)


class BodyStream:
    """A SampleStream over a body in pieces (the HTTP stream's parser, no socket); `fail_at`
    raises after that many pieces, as a connection cut mid-body does."""

    def __init__(self, body: bytes, piece: int = 333, chunk_bytes: int = 1000, fail_at: int | None = None):
        self.pieces = [body[i:i + piece] for i in range(0, len(body), piece)]
        self.parser = BodyParser(chunk_bytes)
        self.fail_at = fail_at
        self.i = 0
        self._head = None
        self.closed = False

    def _next(self):
        if self.fail_at is not None and self.i >= self.fail_at:
            raise ConnectionError("cut")
        p = self.pieces[self.i]
        self.i += 1
        return p

    async def layout(self):
        while self.parser.layout is None:
            self.rest = self.parser.feed_header(memoryview(self._next()))
        return self.parser.layout

    async def chunks(self):
        await self.layout()
        for c in self.parser.feed(self.rest):
            yield c
        while self.i < len(self.pieces):
            for c in self.parser.feed(self._next()):
                yield c
        self._head = self.parser.finish()

    async def head(self):
        return self._head

    async def aclose(self):
        self.closed = True


async def blocking(fn, *args):
    return await asyncio.to_thread(fn, *args)


def write(tmp_path, stream, index=3):
    return asyncio.run(store_stream(tmp_path, SpeculatorsFormat(), index, stream, CTX, blocking))


def test_streamed_file_is_the_whole_paths_file(tmp_path):
    d = make_decoded(1, 57)
    got = write(tmp_path / "s", BodyStream(body_of(d)))
    fmt = SpeculatorsFormat()
    want = fmt.encode_sample(3, d, CTX)
    info = store.write_files_atomic(tmp_path / "w", want.files)
    rel = fmt.hs_path(3)
    assert (tmp_path / "s" / rel).read_bytes() == (tmp_path / "w" / rel).read_bytes()
    assert got.files == info  # size and xxh3 of the same bytes: verify reads either corpus
    assert got.record == want.record
    assert store.check_checksums(tmp_path / "s", {"files": got.files}) == []
    assert fmt.verify_sample(tmp_path / "s", 3, got.record) == []


@pytest.mark.parametrize("fail_at", [0, 1, 5, 20])
def test_a_stream_cut_midway_leaves_no_file(tmp_path, fail_at):
    s = BodyStream(body_of(make_decoded(2, 64)), fail_at=fail_at)
    with pytest.raises(ConnectionError):
        write(tmp_path, s)
    assert not any(p.is_file() for p in tmp_path.rglob("*")), list(tmp_path.rglob("*"))


def test_a_refused_layout_writes_nothing(tmp_path):
    d = make_decoded(3, 9, hidden=HIDDEN * 2)
    with pytest.raises(CorpusFormatError, match="hidden size"):
        write(tmp_path, BodyStream(body_of(d)))
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_an_all_masked_sample_is_dropped_and_leaves_no_file(tmp_path):
    d = make_decoded(4, 20, mask=np.zeros(20, dtype=np.uint8))
    with pytest.raises(StreamDropped):
        write(tmp_path, BodyStream(body_of(d)))
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_budget_admits_what_fits_and_one_oversized_alone():
    async def go():
        b = ByteBudget(10)
        await b.acquire(4)
        await b.acquire(4)
        third = asyncio.ensure_future(b.acquire(4))
        await asyncio.sleep(0.01)
        assert not third.done() and b.held == 8
        await b.release(4)
        await asyncio.wait_for(third, 1)
        await b.release(4)
        await b.release(4)
        await b.acquire(50)  # larger than the budget: admitted when nothing else is held
        big_then_small = asyncio.ensure_future(b.acquire(1))
        await asyncio.sleep(0.01)
        assert not big_then_small.done()
        await b.release(50)
        await asyncio.wait_for(big_then_small, 1)
        return b.peak

    assert asyncio.run(go()) == 50


def test_states_taken_out_of_a_lease_count_against_the_budget():
    """Issue 36: a whole lease's states are copied here before the store; they are held at
    once (no wait: they are in memory already) and later admissions wait for them."""
    async def go():
        b = ByteBudget(10)
        await b.acquire(4)
        b.take(5)
        waiting = asyncio.ensure_future(b.acquire(4))
        await asyncio.sleep(0.01)
        assert not waiting.done() and b.held == 9 and b.peak == 9
        await b.release(9)
        await asyncio.wait_for(waiting, 1)

    asyncio.run(go())


def test_chunk_size_follows_the_budget():
    assert stream_chunk_bytes(16 << 20, 2, 4 << 20) == 4 << 20
    assert stream_chunk_bytes(16 << 20, 8, 4 << 20) == 256 << 10
    assert stream_chunk_bytes(64 << 20, 8, 4 << 20) == 4 << 20
    assert stream_chunk_bytes(1 << 20, 64, 4 << 20) == 256 << 10

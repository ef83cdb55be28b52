"""Issue 38: image chats in a corpus. A response's media mask (its image tokens) is recorded
(`media_runs`), a speculators table gets a `media_mask` column, hsx_format.json counts the
image tokens; both trainers' own readers load the samples with the image tokens' ids and
states and a loss mask that never supervises them; a response that supervises an image
token is refused, and verify flags a record that does; the HTTP body parser and the
stream writer carry the mask."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from hsx import wire
from hsx_client.corpus.formats import CorpusContext, CorpusFormatError, get_format, runs_to_mask
from hsx_client.corpus.formats.common import record_problems
from hsx_client.corpus.stream_write import store_stream
from hsx_client.body_parser import BodyParser
from hsx_client.postnorm import FinalNorm
from _corpus_helpers import HIDDEN, LAYER_IDS, VOCAB, DecodedStream, make_decoded, specforge_rows, write_samples

PAD = 17  # the image token id of these samples


def _image_sample(seed: int, t: int = 40, at: int = 3, n: int = 9) -> wire.Decoded:
    d = make_decoded(seed, t)
    d.token_ids[at:at + n] = PAD
    media = np.zeros(t, np.uint8)
    media[at:at + n] = 1
    d.loss_mask[:] = 0
    d.loss_mask[t // 2:] = 1
    d.media_mask = media
    return d


def _ctx() -> CorpusContext:
    return CorpusContext(layer_ids=list(LAYER_IDS), hidden_size=HIDDEN, dtype="bfloat16",
                         final_norm=FinalNorm(weight=np.ones(HIDDEN, np.float32), eps=1e-5, style="rms"),
                         draft_vocab_size=None, vocab_size=VOCAB, mask_policy="all_turns")


def test_speculators_reads_an_image_chat_corpus(tmp_path):
    data = pytest.importorskip("speculators.train.data", reason="speculators 0.9 not installed")
    decoded = {0: _image_sample(1), 1: make_decoded(2, 12), 2: _image_sample(3, 30, at=0, n=4)}
    records = dict(write_samples(get_format("speculators"), tmp_path, _ctx(), decoded))
    assert records[0]["num_media"] == 9 and runs_to_mask(records[0]["media_runs"]).tolist() == decoded[0].media_mask.tolist()
    assert "media_runs" not in records[1]  # a text sample has none
    facts = json.loads((tmp_path / "hsx_format.json").read_text())
    assert facts["num_media_tokens"] == 13 and "loss mask never supervises them" in facts["media"]
    ds = data.ArrowDataset(4096, str(tmp_path), on_missing="raise", train_ratio=1.0)
    table = ds.data.with_format(None)
    for i, d in decoded.items():
        row = ds[i]
        assert torch.equal(row["input_ids"], torch.from_numpy(d.token_ids))
        assert torch.equal(row["verifier_last_hidden_states"], d.hidden_states[:, 3])
        media = d.media_mask if d.media_mask is not None else np.zeros(len(d.token_ids), np.uint8)
        assert table[i]["media_mask"] == media.tolist()
        assert not (row["loss_mask"].numpy().astype(bool) & media.astype(bool)).any()


def test_specforge_reads_an_image_chat_corpus(tmp_path):
    pytest.importorskip("specforge", reason="SpecForge 0.2 not installed")
    decoded = {0: _image_sample(4), 1: _image_sample(5, 24, at=1, n=6)}
    records = dict(write_samples(get_format("specforge"), tmp_path, _ctx(), decoded))
    assert [r["num_media"] for r in records.values()] == [9, 6]
    rows = specforge_rows(tmp_path, "eagle3")
    for i, d in decoded.items():
        ids, mask = rows[i]["input_ids"].reshape(-1), rows[i]["loss_mask"].reshape(-1)
        n = len(d.token_ids)
        assert ids[:n].tolist() == d.token_ids.tolist()
        assert not (mask[:n].numpy().astype(bool) & d.media_mask.astype(bool)).any()
    assert json.loads((tmp_path / "hsx_format.json").read_text())["num_media_tokens"] == 15


@pytest.mark.parametrize("name", ["speculators", "specforge"])
def test_a_supervised_image_token_is_refused(tmp_path, name):
    d = _image_sample(6)
    d.loss_mask[4] = 1
    with pytest.raises(CorpusFormatError, match="1 image tokens are supervised"):
        get_format(name).encode_sample(0, d, _ctx())


def test_verify_flags_a_record_that_supervises_image_tokens():
    d = _image_sample(7)
    record = get_format("speculators").encode_sample(0, d, _ctx()).record
    assert record_problems(record, d.token_ids) == []
    record["media_runs"] = record["mask_runs"]
    assert record_problems(record, d.token_ids) == ["the record supervises image tokens (its loss and media masks overlap)"]
    record["media_runs"] = [1]
    assert "media mask covers 1 tokens" in record_problems(record, d.token_ids)[0]


async def _blocking(fn, *args):
    return fn(*args)


def test_the_body_parser_and_the_stream_writer_carry_the_media_mask(tmp_path):
    d = _image_sample(8)
    specs = [wire.TensorSpec("hidden_states", "BF16", tuple(d.hidden_states.shape)),
             wire.TensorSpec("token_ids", "I64", d.token_ids.shape), wire.TensorSpec("loss_mask", "U8", d.loss_mask.shape),
             wire.TensorSpec("media_mask", "U8", d.media_mask.shape)]
    body = wire.encode_header(specs, d.metadata) + b"".join(
        [d.hidden_states.view(torch.uint8).numpy().tobytes(), d.token_ids.tobytes(),
         d.loss_mask.astype(np.uint8).tobytes(), d.media_mask.tobytes()])
    parser = BodyParser(1 << 20)
    list(parser.feed(body))
    assert parser.finish().media_mask.tolist() == d.media_mask.tolist()
    stored = asyncio.run(store_stream(tmp_path, get_format("speculators"), 0, DecodedStream(d), _ctx(), _blocking))
    assert stored.record["media_runs"] == get_format("speculators").encode_sample(0, d, _ctx()).record["media_runs"]

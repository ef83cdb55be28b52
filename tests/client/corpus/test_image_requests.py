"""A token table's (`--states none`) image chats carry the request they were tokenized from
(client/corpus/image_requests.py): written for image rows only, checked by verify, moved with
their rows by finalize's compaction and renumbered by merge. The run loop's side (a real
extract against a fake /tokenize): tests/client/corpus/test_image_inputs.py; the backend's:
tests/client/training/test_online_image_rows.py; a real server: tests/e2e/test_image_chats_e2e.py."""

from __future__ import annotations

import json

import pytest

from hsx_client.corpus import image_requests
from hsx_client.corpus.formats import CorpusContext, get_format
from hsx_client.corpus.formats.speculators_variants import TokensResponse
from hsx_client.corpus.verify import renumbered_path

from _corpus_helpers import HIDDEN, LAYER_IDS, VOCAB, image_chat, text_chat, tokenized, write_samples

LENGTHS = [9, 14, 7, 20, 11, 16]


def _ctx():
    return CorpusContext(layer_ids=list(LAYER_IDS), hidden_size=HIDDEN, dtype="bfloat16", final_norm=None,
                         draft_vocab_size=32, vocab_size=VOCAB, mask_policy="per_turn")


def test_the_request_file_is_written_for_image_chats_only():
    fmt, ctx = get_format("speculators", states="none"), _ctx()
    img = fmt.encode_sample(3, tokenized(1, 12, image_chat(3)), ctx)
    assert sorted(img.files) == ["token_ids/ids_3.safetensors", "token_ids/request_3.json"]
    stored = json.loads(img.files["token_ids/request_3.json"])
    want = {k: v for k, v in image_chat(3).items() if k not in ("id", "layers", "require_supervised")}
    assert stored == want  # the chat, its images, its template switches and truncation: what shapes the tokens
    assert img.record["num_media"] == 3
    text = fmt.encode_sample(4, tokenized(2, 12, text_chat(4)), ctx)
    assert list(text.files) == ["token_ids/ids_4.safetensors"] and "num_media" not in text.record
    assert TokensResponse({"token_ids": [1, 2]}).decode().request is None  # no body given: nothing kept


def _table(tmp_path, bodies: dict[int, dict]):
    fmt, ctx = get_format("speculators", states="none"), _ctx()
    decoded = {i: tokenized(100 + i, LENGTHS[i], b) for i, b in bodies.items()}
    return fmt, write_samples(fmt, tmp_path, ctx, decoded, tokens_only=True)


def test_verify_names_a_missing_or_corrupt_request_file(tmp_path):
    fmt, records = _table(tmp_path, {0: image_chat(0), 1: text_chat(1), 2: image_chat(2)})
    recs = dict(records)
    assert all(fmt.verify_sample(tmp_path, i, r) == [] for i, r in records)
    facts = json.loads((tmp_path / "hsx_format.json").read_text())
    assert facts[image_requests.FORMAT_FACT] == "token_ids/request_{index}.json" and facts["num_media_tokens"] == 6

    (tmp_path / "token_ids/request_2.json").unlink()
    (p,) = fmt.verify_sample(tmp_path, 2, recs[2])
    assert p.startswith("token_ids/request_2.json is missing: sample 2 has 3 image tokens"), p
    (tmp_path / "token_ids/request_0.json").write_bytes(b'{"messages": [')
    (p,) = fmt.verify_sample(tmp_path, 0, recs[0])
    assert p.startswith("sample 0's request file:") and "request_0.json is not JSON" in p, p
    (tmp_path / "token_ids/request_0.json").write_text('{"prompt": "x"}')
    assert "holds no chat" in fmt.verify_sample(tmp_path, 0, recs[0])[0]
    (tmp_path / "token_ids/request_1.json").write_text("[]")  # a text row: checked when present
    assert "sample 1's request file" in fmt.verify_sample(tmp_path, 1, recs[1])[0]


def test_compaction_moves_each_request_file_with_its_row(tmp_path):
    """Samples 1 and 2 failed: finalize moves 4 (an image chat) into 1 and 5 (text) into 2. A
    request file left at 2 by a failed sample (written, never recorded) is not taken for 5's."""
    from datasets import load_from_disk

    fmt, ctx = get_format("speculators", states="none"), _ctx()
    bodies = {0: image_chat(0), 3: text_chat(3), 4: image_chat(4), 5: text_chat(5)}
    decoded = {i: tokenized(200 + i, LENGTHS[i], b) for i, b in bodies.items()}
    (tmp_path / "token_ids").mkdir()
    (tmp_path / "token_ids/request_2.json").write_text(json.dumps(image_chat(2)))
    records = write_samples(fmt, tmp_path, ctx, decoded, tokens_only=True)
    names = sorted(p.name for p in (tmp_path / "token_ids").iterdir())
    assert names == ["ids_0.safetensors", "ids_1.safetensors", "ids_2.safetensors", "ids_3.safetensors",
                     "request_0.json", "request_1.json"]
    assert json.loads((tmp_path / "token_ids/request_1.json").read_text())["messages"] == image_chat(4)["messages"]
    table = load_from_disk(str(tmp_path)).with_format(None)
    assert table[1]["input_ids"] == decoded[4].token_ids.tolist() and any(table[1]["media_mask"])
    assert not any(table[2]["media_mask"])
    fmt.finalize(tmp_path, records, ctx)  # a rerun (the journal replayed) changes nothing
    assert sorted(p.name for p in (tmp_path / "token_ids").iterdir()) == names
    moved = {old: new for old, new in json.loads((tmp_path / "hsx_compaction.json").read_text())["moves"]}
    assert moved == {4: 1, 5: 2}
    for i, rec in records:
        assert fmt.verify_sample(tmp_path, moved.get(i, i), rec) == [], i


def test_a_rerun_finishes_a_compaction_cut_between_a_row_and_its_request(tmp_path):
    """A crash after the row's id file moved and before its request file did: the rerun moves it."""
    fmt, ctx = get_format("speculators", states="none"), _ctx()
    decoded = {i: tokenized(300 + i, LENGTHS[i], image_chat(i)) for i in (0, 2)}
    records = write_samples(fmt, tmp_path, ctx, decoded, tokens_only=True)
    assert not (tmp_path / "token_ids/request_2.json").exists()
    (tmp_path / "token_ids/request_1.json").rename(tmp_path / "token_ids/request_2.json")  # the move undone
    fmt.finalize(tmp_path, records, ctx)
    assert not (tmp_path / "token_ids/request_2.json").exists()
    assert json.loads((tmp_path / "token_ids/request_1.json").read_text())["messages"] == image_chat(2)["messages"]


@pytest.mark.parametrize("old,new", [(3, 7), (12, 0)])
def test_merge_and_verify_renumber_the_request_file(old, new):
    fmt = get_format("speculators", states="none")
    assert renumbered_path(fmt, f"token_ids/request_{old}.json", old, new) == f"token_ids/request_{new}.json"
    assert renumbered_path(fmt, f"token_ids/ids_{old}.safetensors", old, new) == f"token_ids/ids_{new}.safetensors"


def test_the_disk_estimate_counts_each_image_chat_s_request_file(tmp_path):
    """The request files hold the images' base64, not tokens: a token table of image chats
    needs their bytes on disk, files named by path counted as the data URIs they become."""
    from hsx_client.corpus.disk_estimate import disk_needed
    from hsx_client.corpus.images import image_part

    photo = tmp_path / "photo.jpg"
    photo.write_bytes(b"\xff\xd8\xff" + bytes(30_000))
    by_path = {"messages": [{"role": "user", "content": [image_part(photo.as_uri()), {"type": "text", "text": "hi"}]}]}
    fmt = get_format("speculators", states="none")
    inlined = image_requests.encode({"messages": [{"role": "user", "content": [
        image_part("data:image/jpeg;base64," + "A" * ((30_003 + 2) // 3 * 4)), {"type": "text", "text": "hi"}]}]})
    assert abs(fmt.bytes_per_request(by_path) - len(inlined)) < 64
    assert fmt.bytes_per_request(text_chat(1)) == 0
    assert get_format("speculators").bytes_per_request(by_path) == 0  # the states formats keep no request
    plain = disk_needed([by_path, text_chat(1)], 24, None, None)
    assert disk_needed([by_path, text_chat(1)], 24, None, None, bytes_per_request=fmt.bytes_per_request) \
        == plain + fmt.bytes_per_request(by_path)

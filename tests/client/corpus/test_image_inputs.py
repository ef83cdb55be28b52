"""Issue 38: `hsx extract` reads image chats (hsx_client.corpus.images): OpenAI image parts
(paths relative to the input file, data URIs), LLaVA / ShareGPT-4V rows, a Hugging Face
dataset with an image column; a missing image file or a bad row is one BadRow naming it; the
plan keeps `file://` paths and the request carries the image bytes as a data URI."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest

import _image_chats as chats
from _first_hour import InfoServer
from hsx_client.corpus import images
from hsx_client.corpus.inputs import read_samples


def _image_urls(msgs: list[dict]) -> list[str]:
    return [p["image_url"]["url"] for m in msgs if isinstance(m["content"], list)
            for p in m["content"] if p.get("type") == "image_url"]


@pytest.fixture
def fixture_dir(tmp_path) -> Path:
    return chats.write_fixture(tmp_path / "chats")


def test_openai_rows_keep_their_images_as_absolute_paths_or_data_uris(fixture_dir):
    bad: list = []
    samples = read_samples([str(fixture_dir / "openai.jsonl")], mask_policy="per_turn", bad_rows=bad)
    assert not bad and len(samples) == 6  # 2 + 1 + 1 + 2 assistant turns
    first = _image_urls(samples[0].request["messages"])
    assert first == [(fixture_dir / "images" / "hopper.jpg").resolve().as_uri()]
    assert _image_urls(samples[2].request["messages"])[0].startswith("data:image/png;base64,")
    assert len(_image_urls(samples[3].request["messages"])) == 2
    body = images.inline(samples[0].request)
    (url,) = _image_urls(body["messages"])
    assert base64.b64decode(url.split(",", 1)[1]) == (fixture_dir / "images" / "hopper.jpg").read_bytes()
    assert url.startswith("data:image/jpeg;base64,")
    assert _image_urls(samples[0].request["messages"]) == first  # the plan's request is not changed


def test_llava_rows_put_each_image_at_its_placeholder(fixture_dir):
    samples = read_samples([str(fixture_dir / "llava.json")], mask_policy="all_turns")
    assert len(samples) == len(chats.QA)
    user = samples[2].request["messages"][0]
    assert user["content"][0] == images.image_part((fixture_dir / "images" / "mri.png").resolve().as_uri())
    assert user["content"][1] == {"type": "text", "text": chats.QA[2][1]}


@pytest.mark.slow  # datasets' import and save_to_disk: about 2 s
def test_a_hugging_face_dataset_with_an_image_column(fixture_dir):
    path = chats.hf_dataset(fixture_dir)
    samples = read_samples([str(path)], mask_policy="all_turns")
    assert len(samples) == len(chats.QA)
    (url,) = _image_urls(samples[1].request["messages"])
    assert base64.b64decode(url.split(",", 1)[1]) == chats.image_bytes("hopper.jpg")  # the stored bytes, not re-encoded


ROWS = {
    "a missing image file": ({"image": "images/nowhere.jpg", "conversations": [
        {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A."}]},
        "missing_image", "image file not found: "),
    "a missing file in an OpenAI part": ({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "gone.png"}}]},
        {"role": "assistant", "content": "A."}]}, "missing_image", "messages[0].content[0]: image file not found"),
    "more placeholders than images": ({"image": "images/gift.png", "conversations": [
        {"from": "human", "value": "<image> and <image>"}, {"from": "gpt", "value": "A."}]},
        "malformed", "more <image> placeholders than images"),
    "more images than places": ({"images": ["images/gift.png", "images/mri.png"], "conversations": [
        {"from": "human", "value": "<image> what?"}, {"from": "gpt", "value": "A."}]},
        "malformed", "2 images and only 1 places"),
    "an image part without a url": ({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": "A."}]}, "malformed", "needs image_url.url"),
    "an image that is a number": ({"image": 7, "conversations": [
        {"from": "human", "value": "<image>"}, {"from": "gpt", "value": "A."}]},
        "malformed", "an image must be a path, a URL or image bytes"),
}


@pytest.mark.parametrize("case", list(ROWS))
def test_a_bad_image_row_is_one_bad_row_and_the_others_are_read(fixture_dir, case):
    row, kind, words = ROWS[case]
    good = chats.llava_rows()[0]
    path = fixture_dir / "mixed.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    bad: list = []
    samples = read_samples([str(path)], bad_rows=bad)
    assert [s.source for s in samples] == [f"{path}:1"]
    assert len(bad) == 1 and bad[0].kind == kind and words in bad[0].reason, bad
    assert "\n" not in bad[0].reason


def test_an_image_file_gone_after_planning_is_a_clear_error(fixture_dir):
    (sample, *_) = read_samples([str(fixture_dir / "openai.jsonl")])
    (fixture_dir / "images" / "hopper.jpg").unlink()
    with pytest.raises(images.ImageFileError, match=r"hopper\.jpg: No such file"):
        images.inline(sample.request)


def test_a_text_row_mentioning_the_placeholder_is_untouched(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": f"Is <image> a tag {k}?"}, {"from": "gpt", "value": "Yes."}]}
            for k in range(2000)]
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = read_samples([str(path)])
    assert samples[0].request["messages"][0]["content"] == "Is <image> a tag 0?"  # no image field: plain text
    assert not images.needs_inlining(samples[0].request)


def test_an_empty_image_field_is_a_text_row(tmp_path):
    """Mixed datasets give their text rows `"image": ""` or null."""
    path = tmp_path / "mixed.jsonl"
    rows = [{"image": v, "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}
            for v in ("", None, [])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad: list = []
    samples = read_samples([str(path)], bad_rows=bad)
    assert not bad and [s.request["messages"][0]["content"] for s in samples] == ["Hi"] * 3


class TokenizingServer(InfoServer):
    """InfoServer with a /tokenize of its own: each text part a few ids, each image four
    image tokens (id 99, media mask 1), the assistant's tokens supervised; records the
    bodies it tokenized."""

    def __init__(self, **info):
        super().__init__(**info)
        self.tokenized: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/tokenize":
            return super().__call__(request)
        body = json.loads(request.content)
        self.tokenized.append(body)
        ids, loss, media = [], [], []
        for m in body["messages"]:
            parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            for part in parts:
                image = part["type"] == "image_url"
                n = 4 if image else 1 + len(part["text"]) // 8
                ids += [99] * n if image else [(len(ids) + 7 * k) % 90 + 1 for k in range(n)]
                loss += [int(m["role"] == "assistant")] * n
                media += [int(image)] * n
        return httpx.Response(200, json={"token_ids": ids, "loss_mask": loss, "media_mask": media,
                                         "num_input_tokens": len(ids), "layer_ids": [1, 2, 3, 4]})


def _extract_tokens(tmp_path, inputs: Path, srv):
    from hsx_client.corpus import extract as ex
    from hsx_client.corpus.formats import get_format
    from _extract_fakes import FakeCtx, cfg_for

    out = tmp_path / "out"
    cfg = cfg_for(inputs, out, format="speculators", states="none")
    hooks = ex.Hooks(read_samples=read_samples, get_format=get_format, make_context=FakeCtx)
    return out, ex.run_extract(cfg, hooks, transport=httpx.MockTransport(srv))


def test_a_token_table_stores_each_image_chats_request_beside_its_ids(tmp_path, fixture_dir):
    """--states none: the request the server tokenized (images read from their paths into data
    URIs, as sent) is stored for every image chat and for no text one; verify checks it."""
    from hsx_client.corpus import image_requests, journal, store
    from hsx_client.corpus.verify import verify_corpus

    srv = TokenizingServer(layer_ids=[1, 2, 3, 4], chat_template_sha256="abc")
    out, r = _extract_tokens(tmp_path, fixture_dir / "openai.jsonl", srv)
    assert r.exit_code == 0 and r.summary["done"] == 6, r.summary
    entries, _, _ = journal.read_jsonl(out / store.MANIFEST_NAME)
    with_images = 0
    for e in journal.latest_by_index(entries).values():
        rel = image_requests.request_path(e["index"])
        assert (rel in e["files"]) == bool(e["record"].get("num_media")), e
        if rel in e["files"]:
            with_images += 1
            body = json.loads((out / rel).read_text())
            assert {"id", "layers", "require_supervised"}.isdisjoint(body) and body["truncation"] and body["max_length"]
            assert all(u.startswith("data:image/") for u in _image_urls(body["messages"]))
            assert body["messages"] in [b["messages"] for b in srv.tokenized]  # what the server tokenized
    assert with_images == 5  # every sample but the first turn of the chat whose image comes second
    assert verify_corpus(out)["ok"]
    victim = next(e for e in journal.latest_by_index(entries).values() if e["record"].get("num_media"))
    (out / image_requests.request_path(victim["index"])).unlink()
    (bad,) = verify_corpus(out)["bad"]
    assert bad["index"] == victim["index"] and any("request_" in p for p in bad["problems"]), bad


def test_a_token_table_of_chats_with_remote_images_is_refused_before_any_sample(tmp_path):
    """A remote image is not in the request the token table stores (the server fetches it,
    when allowed): the online backend could get another image, so --states none refuses it."""
    from _first_hour import refused_and_untouched

    path = tmp_path / "remote.jsonl"
    row = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A cat."}]}
    path.write_text(json.dumps(row) + "\n")
    srv = InfoServer(layer_ids=[1, 2, 3, 4], chat_template_sha256="abc")
    out, r = _extract_tokens(tmp_path, path, srv)
    refused_and_untouched(r, out, srv, r"1 planned sample\(s\) are chats with images at http\(s\) URLs, and --states none")


def test_video_parts_resolve_like_image_parts(tmp_path):
    """A video_url part's relative path is taken from the input file's directory, kept as a
    file:// URL in the plan and sent as a data: URI; a missing video is a BadRow naming it."""
    (tmp_path / "clips").mkdir()
    clip = b"\x00\x00\x00\x18ftypisom" + b"\x00" * 32  # the client does not decode it (the server does)
    (tmp_path / "clips" / "a.mp4").write_bytes(clip)
    rows = [{"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                       {"type": "text", "text": "What happens?"}]},
                          {"role": "assistant", "content": "A portrait moves."}]}
            for url in ("clips/a.mp4", "clips/gone.mp4")]
    (tmp_path / "v.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad: list = []
    (sample,) = read_samples([str(tmp_path / "v.jsonl")], bad_rows=bad)
    assert len(bad) == 1 and "video file not found" in bad[0].reason and "gone.mp4" in bad[0].reason
    part = sample.request["messages"][0]["content"][0]
    assert part == images.video_part((tmp_path / "clips" / "a.mp4").resolve().as_uri())
    assert images.request_has_images(sample.request) and images.needs_inlining(sample.request)
    sent = images.inline(sample.request)["messages"][0]["content"][0]["video_url"]["url"]
    assert sent.startswith("data:video/mp4;base64,") and base64.b64decode(sent.split(",", 1)[1]) == clip

"""Issue 38: `hsx extract` reads image chats (hsx_client.corpus.images): OpenAI image parts
(paths relative to the input file, data URIs), LLaVA / ShareGPT-4V rows, a Hugging Face
dataset with an image column; a missing image file or a bad row is one BadRow naming it; the
plan keeps `file://` paths and the request carries the image bytes as a data URI."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

import _image_chats as chats
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


def test_a_token_table_of_image_chats_is_refused_before_any_sample(tmp_path):
    """--states none writes ids only, and the online backend asks for a row's states by its ids,
    which cannot carry the images: refused at start, one line, the output left as it was."""
    import httpx

    from hsx_client.corpus import extract as ex
    from hsx_client.corpus.formats import get_format
    from _extract_fakes import FakeCtx, cfg_for
    from _first_hour import InfoServer, refused_and_untouched

    root = chats.write_fixture(tmp_path / "chats")
    out = tmp_path / "out"
    srv = InfoServer(layer_ids=[1, 2, 3, 4], chat_template_sha256="abc")
    cfg = cfg_for(root / "openai.jsonl", out, format="speculators", states="none")
    hooks = ex.Hooks(read_samples=read_samples, get_format=get_format, make_context=FakeCtx)
    r = ex.run_extract(cfg, hooks, transport=httpx.MockTransport(srv))
    refused_and_untouched(r, out, srv, r"chats with images, and --states none writes token ids only")

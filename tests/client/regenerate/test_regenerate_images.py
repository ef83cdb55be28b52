"""Issue 38: `hsx regenerate` with images (speculators' regeneration refuses them). Without an
engine: the real run, journal and client against an in-process OpenAI-style endpoint (httpx
MockTransport) over the image-chat fixture. Each turn is asked with the images of the
messages before it, sent as data URIs; the output keeps them (as the files' absolute
`file://` URLs); a resumed run writes the file an uninterrupted one does; a server that
takes no images refuses the run before any work; an image file gone mid-run fails only its
conversations; extract reads an output row with images from its messages."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest

import _image_chats as chats
from hsx_client.corpus.inputs import read_samples
from hsx_client.regenerate.run import RegenConfig, run_regenerate
from hsx_client.regenerate.turns import Sampling
from hsx_client.settings import ClientSettings


def _urls(messages: list[dict]) -> list[str]:
    return [p["image_url"]["url"] for m in messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image_url"]


class VisionEndpoint:
    """/v1/chat/completions that takes images (or not: `takes_images`), records each chat's
    images as bytes, and refuses the questions in `refuse` (a 422)."""

    def __init__(self, takes_images: bool = True, refuse: frozenset[str] = frozenset(), on_request=None):
        self.takes_images, self.refuse, self.on_request = takes_images, refuse, on_request
        self.seen: list[list[bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/info", "/health"):
            return httpx.Response(200, json={"model": "fake/vision"})
        if self.on_request is not None:
            self.on_request()
        body = json.loads(request.content)
        urls = _urls(body["messages"])
        if urls and not self.takes_images:
            return httpx.Response(400, json={"error": {"type": "invalid_request", "message":
                                  "messages[0].content[0]: image_url parts need a model that takes images"}})
        assert all(u.startswith("data:") for u in urls), "the client sends image bytes, never its paths"
        text = json.dumps([m["content"] for m in body["messages"]])
        if any(q in text for q in self.refuse):
            return httpx.Response(422, json={"error": {"type": "unlucky", "message": "not this time"}})
        self.seen.append([base64.b64decode(u.split(",", 1)[1]) for u in urls])
        return httpx.Response(200, json={"prompt_token_ids": [1, 2, 3] + [9] * (4 * len(urls)), "choices": [{
            "message": {"role": "assistant", "content": f"I see {len(urls)} image(s)."}, "finish_reason": "stop",
            "token_ids": [7, 8, 2]}]})


def regenerate(inputs: list[str], out, endpoint, **settings):
    cfg = RegenConfig(client=ClientSettings.given(["http://fake"], max_attempts=1, **settings), inputs=inputs,
                      output=out, sampling=Sampling(), quiet=True, transport=httpx.MockTransport(endpoint))
    return asyncio.run(run_regenerate(cfg))


@pytest.fixture
def inputs(tmp_path) -> list[str]:
    root = chats.write_fixture(tmp_path / "chats")
    return [str(root / "openai.jsonl"), str(root / "llava.json")]


def test_each_turn_sees_its_images_and_the_output_keeps_them(inputs, tmp_path):
    endpoint = VisionEndpoint()
    r = regenerate(inputs, tmp_path / "regen.jsonl", endpoint)
    assert r.exit_code == 0 and r.summary["regenerated"] == 4 + len(chats.QA), r.summary
    rows = [json.loads(line) for line in (tmp_path / "regen.jsonl").read_text().splitlines()]
    hopper = (tmp_path / "chats" / "images" / "hopper.jpg")
    first = rows[0]
    assert _urls(first["messages"]) == [hopper.resolve().as_uri()]  # kept as the file, not its bytes
    assert [m["content"] for m in first["messages"] if m["role"] == "assistant"] == ["I see 1 image(s)."] * 2
    assert endpoint.seen.count([hopper.read_bytes()]) >= 2 + 1  # both turns of row 1 and the LLaVA row
    assert [2] in [[len(s)] for s in endpoint.seen]  # the chat with two images sent both
    late = rows[3]  # its first turn has no image yet, its second has one
    assert len(late["hsx_turns"]) == 2 and len(late["hsx_turns"][1]["prompt_token_ids"]) == 3 + 4
    samples = read_samples([str(tmp_path / "regen.jsonl")], mask_policy="all_turns")
    assert _urls(samples[0].request["messages"]) == [hopper.resolve().as_uri()]  # read from its messages
    assert samples[0].request["messages"][2]["content"] == "I see 1 image(s)."


def test_a_resumed_run_writes_the_same_file(inputs, tmp_path):
    whole = regenerate(inputs, tmp_path / "whole.jsonl", VisionEndpoint())
    assert whole.exit_code == 0
    out = tmp_path / "resumed.jsonl"
    first = regenerate(inputs, out, VisionEndpoint(refuse=frozenset({chats.QA[2][1], chats.QA[3][1]})))
    assert first.exit_code == 1 and first.summary["failed"] > 0 and first.summary["regenerated"] > 0
    again = regenerate(inputs, out, VisionEndpoint())
    assert again.exit_code == 0 and again.summary["done_before"] == first.summary["regenerated"]
    assert out.read_bytes() == (tmp_path / "whole.jsonl").read_bytes()


def test_a_server_that_takes_no_images_refuses_the_run_before_any_work(inputs, tmp_path):
    out = tmp_path / "regen.jsonl"
    r = regenerate(inputs, out, VisionEndpoint(takes_images=False))
    assert r.exit_code == 2 and "the server refuses image chats (8 of the conversations have images)" in r.summary["error"]
    assert not out.exists() and not list(tmp_path.glob("regen.jsonl*"))


def test_an_image_file_gone_mid_run_fails_its_conversations_only(inputs, tmp_path):
    gift = tmp_path / "chats" / "images" / "gift.png"
    calls = []

    def delete_after_preflight():
        calls.append(1)
        if len(calls) == 2:  # the two preflight chats went through
            gift.unlink()

    r = regenerate(inputs, tmp_path / "regen.jsonl", VisionEndpoint(on_request=delete_after_preflight),
                   concurrency_per_server=1)
    assert r.exit_code == 1 and r.summary["failed_by_reason"] == {"missing_image": 3}, r.summary
    assert "gift.png" in r.summary["failed_example_by_reason"]["missing_image"]
    assert r.summary["regenerated"] == 4 + len(chats.QA) - 3

"""Issue 38: images on POST /v1/chat/completions, without an engine: the same parts, limits
and refusals as /hidden_states (service/media, one owner), each naming the part; an image's
bytes count against no text bound and never reach the tokenizer processes; the engine gets
the prompt vLLM's renderer made (pixels and all), and the reply's prompt ids are the expanded
ones. The real engine's side: tests/service/engine/test_qwen_vl_images.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

import _images as img
from hsx_service.chat_content import IMAGE_PLACEHOLDER
from hsx_service.core.errors import BadInput, TooLarge
from hsx_service.http import routes_generation
from hsx_service.http.routes_generation import ChatCompletionRequest, Generator
from hsx_service.media.chat_media import ChatMedia
from hsx_service.media.limits import MediaLimits
from hsx_service.tokenize import Encoded

PAD = 9
QWEN = "Qwen2_5_VLForConditionalGeneration"


class _Tokenizer:
    def __init__(self) -> None:
        self.messages: list | None = None

    async def encode(self, kind, messages, *args, **bounds):
        assert kind == "generation"
        self.messages = messages
        return Encoded([1, PAD, 3], None, "none")


class _Renderer:
    async def render_cmpl_async(self, prompts, skip_mm_cache=False):
        (prompt,) = prompts
        assert prompt["prompt_token_ids"] == [1, PAD, 3] and len(prompt["multi_modal_data"]["image"]) == 1
        return [{"prompt_token_ids": [1, PAD, PAD, PAD, 3], "mm_placeholders": {"image": [
            SimpleNamespace(offset=1, length=3)]}, "tag": "rendered"}]


class _Engine:
    renderer = _Renderer()

    def __init__(self) -> None:
        self.prompts: list = []

    async def generate(self, prompt, params, request_id):
        self.prompts.append(prompt)
        yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(
            text="Red.", token_ids=[5, 6], finish_reason="stop", stop_reason=None)])


def _generator(architecture: str = QWEN, multimodal: bool = True, **limits) -> Generator:
    engine = _Engine()
    facts = SimpleNamespace(served_model_name="m", model="m", max_model_len=64)
    media = ChatMedia(MediaLimits(**limits), lambda: engine,
                       SimpleNamespace(is_multimodal_model=multimodal), architecture)
    service = SimpleNamespace(media=media, max_text_bytes=1000, tokenizer=_Tokenizer())
    st = SimpleNamespace(prefill=SimpleNamespace(vllm_config=None, facts=facts, engine=engine), service=service,
                         settings=SimpleNamespace(max_messages=16, request_timeout=30))
    return Generator(st)


def _complete(gen: Generator, *urls: str):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": [
        *map(img.image_part, urls), {"type": "text", "text": "What is it?"}]}], max_tokens=2, temperature=0)
    ticket = SimpleNamespace(client="c", admit=lambda n: None)
    return asyncio.run(gen.complete(body, "r1", ticket))


@pytest.fixture(autouse=True)
def _no_vllm_sampling(monkeypatch):
    monkeypatch.setattr(routes_generation, "sampling_params", lambda body, n, most: SimpleNamespace(max_tokens=2))


def test_an_image_chat_goes_to_the_engine_as_the_renderer_made_it():
    gen = _generator()
    big = img.data_uri(img.png(300, 300) + b"\0" * 4000)  # over the 1000 text bytes: images are no text
    out = _complete(gen, big)
    assert out["prompt_token_ids"] == [1, PAD, PAD, PAD, 3] and out["usage"]["prompt_tokens"] == 5
    assert out["choices"][0]["token_ids"] == [5, 6] and out["choices"][0]["message"]["content"] == "Red."
    assert gen.st.prefill.engine.prompts[0]["tag"] == "rendered"
    sent = gen.st.service.tokenizer.messages
    assert sent[0]["content"][0] == IMAGE_PLACEHOLDER and "data:" not in repr(sent)


@pytest.mark.parametrize("url, kind, words", [
    (img.data_uri(img.SVG, "image/svg+xml"), BadInput, "SVG images are not accepted"),
    (img.data_uri(img.png(64, 64)[:-40]), BadInput, "truncated or corrupt"),
    (img.data_uri(img.png_bomb()), TooLarge, "--max-image-pixels"),
    ("http://127.0.0.1:9/a.png", BadInput, "remote image URLs are off"),
    ("/etc/passwd", BadInput, "local image paths are off"),
], ids=["svg", "truncated", "pixel-bomb", "remote", "local-path"])
def test_bad_images_are_refused_naming_the_part(url, kind, words):
    gen = _generator()
    with pytest.raises(kind, match=words) as e:
        _complete(gen, url)
    assert str(e.value).startswith("messages[0].content[0]: ")
    assert gen.st.service.tokenizer.messages is None and not gen.st.prefill.engine.prompts


def test_too_many_images_and_a_text_only_model_are_refused():
    with pytest.raises(TooLarge, match="more than --max-images-per-request 1 images"):
        _complete(_generator(max_images=1), *[img.data_uri(img.png())] * 2)
    with pytest.raises(BadInput, match=r"messages\[0\]\.content\[0\]: image_url parts need a model that takes "
                                       r"images; this one \(LlamaForCausalLM\) does not"):
        _complete(_generator("LlamaForCausalLM", multimodal=False), img.data_uri(img.png()))


def test_an_expansion_past_the_context_is_refused_before_admission():
    gen = _generator()
    gen.st.prefill.facts.max_model_len = 5  # 5 expanded tokens > 4 (one left to generate)
    with pytest.raises(TooLarge, match=r"limit of 4 \(max_model_len less one token to generate\)"):
        _complete(gen, img.data_uri(img.png()))
    assert not gen.st.prefill.engine.prompts


@pytest.mark.parametrize("part", [
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
    {"type": "video", "video": "file:///tmp/a.mp4"},
], ids=["video_url", "video"])
def test_a_video_part_is_a_400_naming_it_where_the_processor_takes_no_video(part):
    """A video part goes only to a model whose vLLM processor allows video (this fake renderer's
    has no processor to ask); else it is refused by name before the tokenizer or the engine
    sees the chat, as is a bare placeholder-like `video` part."""
    from hsx_service.http.errors import status_of

    gen = _generator()
    body = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "text", "text": "What happens?"}, part]}], max_tokens=2, temperature=0)
    ticket = SimpleNamespace(client="c", admit=lambda n: None)
    words = r"this model \(Qwen2_5_VLForConditionalGeneration\) takes no video" if part["type"] == "video_url" \
        else "send videos as video_url parts"
    with pytest.raises(BadInput, match=rf"messages\[0\]\.content\[1\]: {words}") as e:
        asyncio.run(gen.complete(body, "r1", ticket))
    assert status_of(e.value) == 400
    assert gen.st.service.tokenizer.messages is None and not gen.st.prefill.engine.prompts

"""Issue 38: a chat's images between the request and the engine, without an engine: image
parts become the template's placeholder (and only parts templates render one), the loss
mask and the media mask follow the processor's expansion of each placeholder, and a request
with an image part for a text-only model is refused naming the part."""

from __future__ import annotations

import asyncio

import pytest

import _images as img
from hsx_service.chat_content import IMAGE_PLACEHOLDER, content_format, normalize_messages
from hsx_service.core.errors import BadInput, EngineTimeout, TooLarge
from hsx_service.core.schema import HiddenStatesRequest
from hsx_service.media.chat_media import ChatMedia, expand_masks
from hsx_service.media.limits import MediaLimits
from hsx_tools.tiny_model import CHAT_TEMPLATE as STRING_TEMPLATE
from hsx_tools.tiny_vlm import KIMI_CHAT_TEMPLATE

PAD, BEGIN, END = 9, 7, 8


def test_expansion_carries_both_masks():
    before = [1, 2, BEGIN, PAD, END, 3, BEGIN, PAD, END, 4, 5]
    loss = [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    after = [1, 2, BEGIN, *[PAD] * 4, END, 3, BEGIN, *[PAD] * 2, END, 4, 5]
    media, out = expand_masks(before, after, [(3, 4), (10, 2)], loss)
    assert media == [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0]
    assert out == [0] * 13 + [1, 1]
    assert expand_masks(before, after, [(3, 4), (10, 2)], None)[1] is None


def test_an_image_token_is_never_supervised():
    """An image in an assistant turn (a mask of 1 over its placeholder) is still unsupervised."""
    media, out = expand_masks([1, PAD, 2], [1, PAD, PAD, PAD, 2], [(1, 3)], [1, 1, 1])
    assert media == [0, 1, 1, 1, 0] and out == [1, 0, 0, 0, 1]


def test_a_processor_that_changes_text_tokens_is_an_error():
    with pytest.raises(BadInput, match="changed the chat's text tokens"):
        expand_masks([1, PAD, 2], [1, PAD, PAD, 3], [(1, 2)], None)


def test_parts_templates_render_the_placeholder_and_string_templates_refuse_it():
    msgs = [{"role": "user", "content": [IMAGE_PLACEHOLDER, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "Red."}]
    assert content_format(KIMI_CHAT_TEMPLATE) == "parts"
    parts = normalize_messages(msgs, "parts")[0]["content"]
    assert parts == [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    assert content_format(STRING_TEMPLATE) == "string"
    with pytest.raises(BadInput, match=r"messages\[0\]\.content\[0\]: this chat template renders no images"):
        normalize_messages(msgs, "string")


class _Config:
    is_multimodal_model = True


def _chat(*parts) -> HiddenStatesRequest:
    return HiddenStatesRequest(messages=[{"role": "user", "content": list(parts)},
                                         {"role": "assistant", "content": "ok"}])


def test_take_loads_images_and_leaves_placeholders():
    media = ChatMedia(MediaLimits(), lambda: None, _Config(), "KimiK25ForConditionalGeneration")
    req = _chat({"type": "text", "text": "a"}, img.image_part(img.data_uri(img.png(20, 10))))
    out, images = asyncio.run(media.take(req))
    assert [i.size for i in images] == [(20, 10)]
    assert out.messages[0].content == [{"type": "text", "text": "a"}, IMAGE_PLACEHOLDER]
    assert "data:" not in out.model_dump_json()  # the bytes never reach the tokenizer processes
    assert media._mm_data(images)["vision_chunk"][0]["image"] is images[0]


def test_a_text_only_model_refuses_image_parts_by_name():
    media = ChatMedia(MediaLimits(), lambda: None, None, "LlamaForCausalLM")
    with pytest.raises(BadInput, match=r"messages\[0\]\.content\[1\]: image_url parts need a model that takes images; "
                       r"this one \(LlamaForCausalLM\) does not"):
        asyncio.run(media.take(_chat({"type": "text", "text": "a"}, img.image_part(img.data_uri(img.png())))))


def test_raw_placeholder_parts_are_refused():
    media = ChatMedia(MediaLimits(), lambda: None, _Config(), "KimiK25ForConditionalGeneration")
    with pytest.raises(BadInput, match=r"messages\[0\]\.content\[0\]: send images as image_url parts"):
        asyncio.run(media.take(_chat({"type": "image"})))


def test_a_truncated_chat_with_images_is_refused():
    from hsx_service.tokenize import Encoded

    media = ChatMedia(MediaLimits(), lambda: None, _Config(), "KimiK25ForConditionalGeneration")
    with pytest.raises(TooLarge, match="a chat with images is not truncated"):
        asyncio.run(media.expand(Encoded([1, PAD], None, "none"), ["img"], input_tokens=5, limit=2))


def test_the_processors_expansion_is_bounded_by_the_request_timeout():
    """--request-timeout covers the images' whole path: the processor here (the vision encoder
    then runs in the engine's prefill, under the same timeout); a 504 naming the flag."""
    from hsx_service.http.errors import STATUS
    from hsx_service.tokenize import Encoded

    class SlowRenderer:
        async def render_cmpl_async(self, prompts, skip_mm_cache):
            await asyncio.sleep(30)

    class Engine:
        renderer = SlowRenderer()

    media = ChatMedia(MediaLimits(), lambda: Engine(), _Config(), "KimiK25ForConditionalGeneration", timeout=0.05)
    with pytest.raises(EngineTimeout, match=r"did not expand the images within 0.05s \(--request-timeout\)") as e:
        asyncio.run(media.expand(Encoded([1, PAD], None, "none"), ["img"], input_tokens=2, limit=100))
    assert STATUS[type(e.value)] == 504


def test_the_wire_decoder_reads_the_media_mask():
    import json

    import numpy as np

    from hsx import wire

    t = 5
    specs = [wire.TensorSpec("hidden_states", "F32", (t, 1, 2)), wire.TensorSpec("token_ids", "I64", (t,)),
             wire.TensorSpec("media_mask", "U8", (t,))]
    media = np.array([0, 1, 1, 0, 0], dtype=np.uint8)
    body = wire.encode_header(specs, {"layer_ids": json.dumps([1])}) + np.zeros(t * 2, np.float32).tobytes() \
        + np.arange(t, dtype=np.int64).tobytes() + media.tobytes()
    dec = wire.decode(body)
    assert dec.media_mask.tolist() == media.tolist() and dec.loss_mask is None


@pytest.mark.parametrize("arch", ["KimiK25ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"])
@pytest.mark.parametrize("kind, words", [
    ("input_audio", "'input_audio' parts are not supported"),
    ("video", r"send videos as video_url parts"),
    ("video_url", r"this model \((KimiK25|Qwen2_5_VL)ForConditionalGeneration\) takes no video"),
])
def test_an_audio_or_unservable_video_part_is_a_400_naming_the_part(arch, kind, words):
    """Audio is refused for every family; video where vLLM's processor takes none (no engine to
    ask here; Kimi-K2.5's takes video only as vision_chunk items, which hsx does not send), before
    any image of the request is decoded."""
    from hsx_service.http.errors import STATUS

    media = ChatMedia(MediaLimits(), lambda: None, _Config(), arch)
    req = _chat(img.image_part(img.data_uri(img.png())), {"type": kind, kind: {"url": "data:video/mp4;base64,AAAA"}})
    with pytest.raises(BadInput, match=rf"messages\[0\]\.content\[1\]: {words}") as e:
        asyncio.run(media.take(req))
    assert STATUS[type(e.value)] == 400

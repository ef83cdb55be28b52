"""Issue 38, video: video_url parts to decoded frames within the operator's limits, without an
engine. A real MP4 decodes to vLLM's own loader's frames and metadata; every hostile input (not
a video, a playlist, truncated, too many frames, frames too large, too many bytes or videos, a
path out of --allowed-media-dir) is refused fast, naming its part; a model whose vLLM processor
takes no video refuses the part before anything is decoded; a video goes to vLLM's renderer as
a `video` item, and the media mask marks its tokens."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

import _images as img
import _videos as vid
from hsx_service.chat_content import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from hsx_service.core.errors import BadInput, TooLarge
from hsx_service.core.schema import HiddenStatesRequest
from hsx_service.http.errors import status_of
from hsx_service.media.chat_media import ChatMedia
from hsx_service.media.limits import MediaLimits
from hsx_service.media.parts import find_media, load_media
from hsx_service.media.video import Video, decode_video
from hsx_service.tokenize import Encoded

pytest.importorskip("cv2")

LIMITS = MediaLimits(max_images=4, max_videos=2, max_video_bytes=1 << 20, max_video_frames=8,
                     max_video_pixels=1_000_000, max_image_pixels=400_000)
WHERE = "messages[0].content[1]"
QWEN = "Qwen2_5_VLForConditionalGeneration"


@pytest.fixture(scope="module")
def clip() -> bytes:
    return vid.mp4(112, 84, frames=4, fps=2.0)


def load(urls: list[str], limits: MediaLimits = LIMITS) -> list:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, *map(vid.video_part, urls)]}]
    return asyncio.run(load_media(find_media(messages, limits), limits))


def test_an_mp4_decodes_to_vllms_own_frames_and_metadata(clip):
    from vllm.multimodal.video import VideoBackend

    out = decode_video(clip, WHERE, LIMITS)
    frames, meta = VideoBackend.load_bytes(clip)  # vLLM's opencv loader, every frame
    assert out.frames.shape == (4, 84, 112, 3) and out.frames.dtype.name == "uint8"
    assert (out.frames == frames).all() and out.metadata == meta
    assert out.metadata["fps"] == 2.0 and out.metadata["total_num_frames"] == 4
    assert out.frames[0].mean() > 20 and not (out.frames[0] == out.frames[1]).all()  # real, moving frames


@pytest.mark.parametrize("name, make, words", [
    ("text", lambda c: b"hello, not a video at all", "not a video in a supported container"),
    ("png", lambda c: img.png(), "not a video in a supported container"),
    ("hls playlist", lambda c: b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n", "not a video in a supported container"),
    ("truncated", lambda c: c[: len(c) * 2 // 3], "cannot be read|truncated or corrupt"),
    ("header only", lambda c: c[:32], "cannot be read|truncated or corrupt|no frames"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_what_is_not_a_whole_video_is_a_400_naming_the_part(clip, name, make, words):
    t = time.perf_counter()
    with pytest.raises(BadInput, match=rf"^messages\[0\]\.content\[1\]: .*({words})") as e:
        load([vid.data_uri(make(clip))])
    assert status_of(e.value) == 400 and time.perf_counter() - t < 1.0


def test_limits_are_read_from_the_header_before_decoding(clip):
    many = vid.mp4(64, 48, frames=9)
    cases = [
        (many, LIMITS, "the video has 9 frames, over --max-video-frames 8"),
        (clip, replace(LIMITS, max_image_pixels=112 * 84 - 1), "a video frame is 112x84 = 9408 pixels, over "
                                                              "--max-image-pixels 9407"),
        (clip, replace(LIMITS, max_video_pixels=4 * 112 * 84 - 1), "4 frames of 112x84 = 37632 pixels, over "
                                                                   "--max-video-pixels 37631"),
        (clip, replace(LIMITS, max_video_bytes=len(clip) - 8), "the video is over --max-video-bytes"),
    ]
    for data, limits, words in cases:
        t = time.perf_counter()
        with pytest.raises(TooLarge, match=rf"^messages\[0\]\.content\[1\]: .*{words}") as e:
            load([vid.data_uri(data)], limits)
        assert status_of(e.value) == 413 and time.perf_counter() - t < 0.5, words
    assert len(load([vid.data_uri(many)], replace(LIMITS, max_video_frames=9))[0].frames) == 9


def test_too_many_videos_and_a_malformed_part():
    with pytest.raises(TooLarge, match=r"messages\[0\]\.content\[3\]: more than --max-videos-per-request 2 videos"):
        find_media([{"role": "user", "content": [{"type": "text", "text": "a"}, *[vid.video_part("x")] * 3]}], LIMITS)
    with pytest.raises(BadInput, match=r"messages\[0\]\.content\[0\]: a video_url part needs video_url.url"):
        find_media([{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}], LIMITS)


def test_local_videos_stay_inside_the_allowed_dir(tmp_path, clip):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.mp4").write_bytes(clip)
    (tmp_path / "b.mp4").write_bytes(clip)
    limits = replace(LIMITS, allowed_dir=allowed.resolve())
    assert load(["a.mp4"], limits)[0].frames.shape[0] == 4
    with pytest.raises(BadInput, match=r"content\[1\]: the video path is outside --allowed-media-dir"):
        load(["../b.mp4"], limits)
    with pytest.raises(BadInput, match="local video paths are off"):
        load([str(allowed / "a.mp4")])
    with pytest.raises(BadInput, match="remote video URLs are off"):
        load(["https://example.com/a.mp4"])


# ------------------------------------------------------------------------------ with the chat
class _Processor:
    def __init__(self, allowed: dict) -> None:
        self.info = SimpleNamespace(allowed_mm_limits=allowed)


class _Renderer:
    """vLLM's renderer as ChatMedia uses it: two tokens per image, three per video placeholder."""

    def __init__(self, allowed: dict) -> None:
        self.mm_processor = _Processor(allowed)
        self.prompts: list = []

    async def render_cmpl_async(self, prompts, skip_mm_cache=False):
        (prompt,) = prompts
        self.prompts.append(prompt)
        ids, ranges = [], {"image": [], "video": []}
        for t in prompt["prompt_token_ids"]:
            n = {IMG: 2, VID: 3}.get(t, 1)
            if n > 1:
                ranges["image" if t == IMG else "video"].append(SimpleNamespace(offset=len(ids), length=n))
            ids += [t] * n
        return [{"prompt_token_ids": ids, "mm_placeholders": ranges}]


IMG, VID = 9, 10


def _media(allowed: dict, arch: str = QWEN) -> ChatMedia:
    engine = SimpleNamespace(renderer=_Renderer(allowed))
    return ChatMedia(LIMITS, lambda: engine, SimpleNamespace(is_multimodal_model=True), arch)


def _chat(*parts) -> HiddenStatesRequest:
    return HiddenStatesRequest(messages=[{"role": "user", "content": list(parts)},
                                         {"role": "assistant", "content": "ok"}])


def test_a_video_goes_to_the_renderer_as_a_video_item_and_the_mask_marks_its_tokens(clip):
    media = _media({"image": 999, "video": 999})
    req = _chat(vid.video_part(vid.data_uri(clip)), {"type": "text", "text": "and"},
                img.image_part(img.data_uri(img.png(20, 10))))
    out, items = asyncio.run(media.take(req))
    assert out.messages[0].content == [VIDEO_PLACEHOLDER, {"type": "text", "text": "and"}, IMAGE_PLACEHOLDER]
    assert "data:" not in out.model_dump_json()
    assert isinstance(items[0], Video) and items[1].size == (20, 10)
    enc = asyncio.run(media.expand(Encoded([1, VID, 2, IMG, 3], [1, 1, 1, 1, 1], "request"), items, 5, 100))
    assert enc.token_ids == [1, VID, VID, VID, 2, IMG, IMG, 3]
    assert enc.media_mask == [0, 1, 1, 1, 0, 1, 1, 0] and enc.loss_mask == [1, 0, 0, 0, 1, 0, 0, 1]
    (sent,) = media._engine().renderer.prompts
    (frames, meta), = sent["multi_modal_data"]["video"]
    assert frames is items[0].frames and meta["total_num_frames"] == 4
    assert sent["multi_modal_data"]["image"] == [items[1]]


@pytest.mark.parametrize("allowed, arch, words", [
    ({"image": 999}, "LlavaForConditionalGeneration", r"this model \(LlavaForConditionalGeneration\) takes no video$"),
    ({"image": 999, "video": 0}, QWEN, rf"this model \({QWEN}\) takes no video$"),
    ({"vision_chunk": 999}, "KimiK25ForConditionalGeneration", r"this model \(KimiK25.*\) takes no video here .*vision_chunk"),
])
def test_a_model_that_takes_no_video_refuses_the_part_before_decoding(allowed, arch, words):
    media = _media(allowed, arch)
    req = _chat(img.image_part(img.data_uri(img.png())), vid.video_part(vid.data_uri(b"not even a video")))
    with pytest.raises(BadInput, match=rf"^messages\[0\]\.content\[1\]: {words}") as e:
        asyncio.run(media.take(req))
    assert status_of(e.value) == 400


def test_the_video_limits_are_settings():
    from hsx_service.settings import ServiceSettings

    s = ServiceSettings(model="m", max_videos_per_request=3, max_video_frames=5, max_video_pixels=7,
                        max_video_bytes="2MiB")
    limits = MediaLimits.from_settings(s)
    assert (limits.max_videos, limits.max_video_frames, limits.max_video_pixels, limits.max_video_bytes) == \
        (3, 5, 7, 2 << 20)

"""Chats with images and videos, between the request and the engine.

`take`: before templating, every `image_url` (`video_url`) part is loaded and decoded
(parts.py, on the media threads, never the event loop) and replaced by the placeholder part
the chat template renders as the model's image (video) placeholder (chat_content's
IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER); the bytes never reach the tokenizer processes. A video
part is taken only where the model's vLLM processor takes video (its allowed modalities).
`expand`: after tokenizing, vLLM's own renderer (the model's multimodal processor, in this
process) expands each placeholder to the image's (video's) tokens; the expanded ids are what
the engine prefills and the response returns, with a media mask marking the image and video
tokens and the loss mask never supervising them. The prompt it made (pixels and all) goes to
the engine as it is: vLLM does not recognise already-expanded placeholders (it expanded a
pre-expanded Kimi-K2.5 prompt a second time), so hsx never sends expanded ids with images.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hsx_service.chat_content import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from hsx_service.core.errors import BadInput, EngineTimeout, TooLarge
from hsx_service.media.limits import MediaLimits
from hsx_service.media.parts import IMAGE_PART_TYPES, VIDEO_PART_TYPES, MediaPart, find_media, load_media
from hsx_service.media.video import Video
from hsx_service.tokenize import Encoded

DECODE_THREADS = 2  # image and video decoding's own threads: a burst of images waits here, not in the loop's pool


class ChatMedia:
    def __init__(self, limits: MediaLimits, engine_getter, model_config: Any = None, architecture: str = "",
                 timeout: float | None = None):
        self.limits = limits
        # --request-timeout: the processor's expansion (resizing, patching, in this process) is
        # bounded like the engine's prefill, where the vision encoder then runs under it.
        self.timeout = timeout
        self._engine = engine_getter  # the AsyncLLM, once started
        self.multimodal = bool(getattr(model_config, "is_multimodal_model", False))
        self.architecture = architecture
        self._video: bool | None = None  # whether vLLM's processor takes video, once asked
        self._pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="hsx-media")

    async def _decode(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def take(self, req):
        """(the request with its images and videos replaced by placeholders, the decoded images
        (PIL) and videos (video.Video) in order)."""
        if not req.messages:
            return req, []
        messages = [{"content": m.content} for m in req.messages]
        for i, m in enumerate(messages):
            for j, part in enumerate(m["content"] if isinstance(m["content"], list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in (IMAGE_PLACEHOLDER["type"], VIDEO_PLACEHOLDER["type"]):
                    raise BadInput(f"messages[{i}].content[{j}]: send {kind}s as {kind}_url parts "
                                   f'({{"type": "{kind}_url", "{kind}_url": {{"url": ...}}}})')
        parts = find_media(messages, self.limits)
        if not parts:
            return req, []
        if not self.multimodal:
            raise BadInput(f"{parts[0].where}: {parts[0].kind}_url parts need a model that takes images; this one "
                           f"({self.architecture}) does not")
        self._check_video(parts)  # before any part is decoded
        items = await load_media(parts, self.limits, decode=self._decode)
        return req.model_copy(update={"messages": _with_placeholders(req.messages)}), items

    def _check_video(self, parts: list[MediaPart]) -> None:
        video = next((p for p in parts if p.kind == "video"), None)
        if video is None or self.takes_video():
            return
        if self.architecture.startswith("KimiK25"):
            raise BadInput(f"{video.where}: this model ({self.architecture}) takes no video here (hsx sends it "
                           "images only; its vision_chunk video path is not served)")
        raise BadInput(f"{video.where}: this model ({self.architecture}) takes no video")

    def takes_video(self) -> bool:
        """Whether the model's vLLM processor allows video items (its supported modalities within
        --limit-mm-per-prompt); False while the engine is not up to ask."""
        if self._video is None:
            processor = getattr(getattr(self._engine(), "renderer", None), "mm_processor", None)
            if processor is None:
                return False
            try:
                self._video = processor.info.allowed_mm_limits.get("video", 0) > 0
            except AttributeError:  # a vLLM whose processor does not say: no video rather than a 500
                self._video = False
        return self._video

    async def expand(self, enc: Encoded, images: list, input_tokens: int, limit: int,
                     limit_name: str = "--max-tokens-per-request / max_length") -> Encoded:
        """`enc` (the chat with one placeholder per image) expanded by the model's processor;
        `limit`: the most tokens it may then have (`limit_name` says where that comes from)."""
        if len(enc.token_ids) < input_tokens:
            raise TooLarge(f"the chat has more than {limit} tokens before its images are expanded, and a chat "
                           "with images is not truncated (an image cut in part has no meaning)")
        renderer = getattr(self._engine(), "renderer", None)
        if renderer is None:
            raise BadInput("images need vLLM >= 0.32 (its renderer expands them); this server's vLLM has none")
        prompt = {"prompt_token_ids": list(enc.token_ids), "multi_modal_data": self._mm_data(images)}
        try:
            # Not through vLLM's processor cache: an item it caches here is taken as sent to the engine,
            # which a /tokenize or a request refused before the engine never does ("P0/P1 cache drift").
            (engine_input,) = await asyncio.wait_for(renderer.render_cmpl_async([prompt], skip_mm_cache=True),
                                                     self.timeout)
        except (ValueError, TypeError, KeyError) as exc:  # vLLM's input checks, the processor's own
            raise BadInput(f"the model's processor refused the images: {exc}") from None
        except asyncio.TimeoutError:
            raise EngineTimeout(f"the model's processor did not expand the images within {self.timeout:g}s "
                                "(--request-timeout)") from None
        ids = list(engine_input["prompt_token_ids"])
        ranges = sorted((p.offset, p.length) for items in engine_input.get("mm_placeholders", {}).values()
                        for p in items)
        if len(ranges) != len(images):
            raise BadInput(f"{len(images)} images and videos but {len(ranges)} placeholders in the rendered chat "
                           "(the chat template renders each image and video part once)")
        if len(ids) > limit:
            raise TooLarge(f"{len(ids)} tokens with the images and videos expanded exceed this request's limit of "
                           f"{limit} ({limit_name}); send smaller or fewer images, or fewer video frames")
        media, loss = expand_masks(enc.token_ids, ids, ranges, enc.loss_mask)
        return Encoded(ids, loss, enc.mask_source, media_mask=media, engine_input=engine_input)

    def _mm_data(self, items: list) -> dict[str, list]:
        images = [x for x in items if not isinstance(x, Video)]
        videos = [x.item for x in items if isinstance(x, Video)]
        # Kimi-K2.5's vLLM processor takes images and video chunks as one modality of items.
        if self.architecture.startswith("KimiK25"):
            return {"vision_chunk": [{"type": "image", "image": im, "uuid": None} for im in images]}
        # each modality's items in the chat's order: vLLM matches them to its placeholders in turn
        return {**({"image": images} if images else {}), **({"video": videos} if videos else {})}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _with_placeholders(messages: list) -> list:
    out = []
    for m in messages:
        if isinstance(m.content, list):
            content = [_placeholder(p) for p in m.content]
            m = m.model_copy(update={"content": content})
        out.append(m)
    return out


def _placeholder(part):
    kind = part.get("type") if isinstance(part, dict) else None
    return IMAGE_PLACEHOLDER if kind in IMAGE_PART_TYPES else VIDEO_PLACEHOLDER if kind in VIDEO_PART_TYPES else part


def expand_masks(before: list[int], after: list[int], ranges: list[tuple[int, int]],
                 loss_mask: list[int] | None) -> tuple[list[int], list[int] | None]:
    """The media mask of `after` (the processor's expansion of `before`: each range of image
    tokens stands where `before` had that image's placeholder tokens) and the loss mask carried
    over from `before`, 0 on every image token."""
    media = [0] * len(after)
    loss = [] if loss_mask is not None else None
    i = j = 0

    def copy_until(stop: int) -> None:
        nonlocal i, j
        while j < stop:
            if i >= len(before) or before[i] != after[j]:
                raise BadInput(f"the model's processor changed the chat's text tokens at {j} (hsx cannot align "
                               "the loss mask with its expansion)")
            if loss is not None:
                loss.append(loss_mask[i])
            i, j = i + 1, j + 1

    for start, length in ranges:
        copy_until(start)
        tokens, taken = set(after[start:start + length]), 0
        while i < len(before) and before[i] in tokens and taken < length:  # the placeholder it replaced
            i, taken = i + 1, taken + 1
        for k in range(start, start + length):
            media[k] = 1
        if loss is not None:
            loss += [0] * length
        j = start + length
    copy_until(len(after))
    if i != len(before):
        raise BadInput("the model's processor dropped tokens of the chat (hsx cannot align the loss mask)")
    return media, loss

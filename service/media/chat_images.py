"""Chats with images, between the request and the engine.

`take`: before templating, every `image_url` part is loaded and decoded (parts.py, on the
media threads, never the event loop) and replaced by the placeholder part the chat template
renders as the model's image placeholder (chat_content.IMAGE_PLACEHOLDER); the image bytes
never reach the tokenizer processes. `expand`: after tokenizing, vLLM's own renderer (the
model's multimodal processor, in this process) expands each placeholder to the image's
tokens; the expanded ids are what the engine prefills and the response returns, with a
media mask marking the image tokens and the loss mask never supervising them. The prompt it
made (pixels and all) goes to the engine as it is: vLLM does not recognise already-expanded
placeholders (it expanded a pre-expanded Kimi-K2.5 prompt a second time), so hsx never sends
expanded ids with images.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hsx_service.chat_content import IMAGE_PLACEHOLDER
from hsx_service.core.errors import BadInput, EngineTimeout, TooLarge
from hsx_service.media.limits import MediaLimits
from hsx_service.media.parts import IMAGE_PART_TYPES, find_images, load_images
from hsx_service.tokenize import Encoded

DECODE_THREADS = 2  # image decoding's own threads: a burst of images waits here, not in the loop's pool


class ChatImages:
    def __init__(self, limits: MediaLimits, engine_getter, model_config: Any = None, architecture: str = "",
                 timeout: float | None = None):
        self.limits = limits
        # --request-timeout: the processor's expansion (resizing, patching, in this process) is
        # bounded like the engine's prefill, where the vision encoder then runs under it.
        self.timeout = timeout
        self._engine = engine_getter  # the AsyncLLM, once started
        self.multimodal = bool(getattr(model_config, "is_multimodal_model", False))
        self.architecture = architecture
        self._pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="hsx-media")

    async def _decode(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def take(self, req):
        """(the request with its images replaced by placeholders, the decoded images)."""
        if not req.messages:
            return req, []
        messages = [{"content": m.content} for m in req.messages]
        for i, m in enumerate(messages):
            for j, part in enumerate(m["content"] if isinstance(m["content"], list) else ()):
                if isinstance(part, dict) and part.get("type") == IMAGE_PLACEHOLDER["type"]:
                    raise BadInput(f"messages[{i}].content[{j}]: send images as image_url parts "
                                   '({"type": "image_url", "image_url": {"url": ...}})')
        parts = find_images(messages, self.limits)
        if not parts:
            return req, []
        if not self.multimodal:
            raise BadInput(f"{parts[0].where}: image_url parts need a model that takes images; this one "
                           f"({self.architecture}) does not")
        images = await load_images(parts, self.limits, decode=self._decode)
        return req.model_copy(update={"messages": _with_placeholders(req.messages)}), images

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
            raise BadInput(f"{len(images)} images but {len(ranges)} image placeholders in the rendered chat "
                           "(the chat template renders each image part once)")
        if len(ids) > limit:
            raise TooLarge(f"{len(ids)} tokens with the images expanded exceed this request's limit of {limit} "
                           f"({limit_name}); send smaller or fewer images")
        media, loss = expand_masks(enc.token_ids, ids, ranges, enc.loss_mask)
        return Encoded(ids, loss, enc.mask_source, media_mask=media, engine_input=engine_input)

    def _mm_data(self, images: list) -> dict[str, list]:
        # Kimi-K2.5's vLLM processor takes images and video chunks as one modality of items.
        if self.architecture.startswith("KimiK25"):
            return {"vision_chunk": [{"type": "image", "image": im, "uuid": None} for im in images]}
        return {"image": images}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _with_placeholders(messages: list) -> list:
    out = []
    for m in messages:
        if isinstance(m.content, list):
            content = [IMAGE_PLACEHOLDER if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES else p
                       for p in m.content]
            m = m.model_copy(update={"content": content})
        out.append(m)
    return out


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

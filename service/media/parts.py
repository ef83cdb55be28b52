"""The image parts of a chat: found, counted, named, and loaded.

An OpenAI image part is `{"type": "image_url", "image_url": {"url": ...}}` (the url may also
be given directly as a string, as some datasets write it). Each is named by its place,
`messages[i].content[j]`, in every refusal.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from hsx_service.core.errors import BadInput, TooLarge
from hsx_service.media.decode import decode_image
from hsx_service.media.limits import MediaLimits
from hsx_service.media.sources import load_bytes

IMAGE_PART_TYPES = ("image_url", "input_image")  # the Chat Completions and the Responses API names
VIDEO_AND_AUDIO = ("video_url", "video", "input_audio", "audio_url", "input_file", "file")


@dataclass(frozen=True)
class ImagePart:
    message: int
    part: int
    url: str

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"


def image_url(part: dict[str, Any], where: str) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise BadInput(f"{where}: an image_url part needs image_url.url, a non-empty string")
    return url


def find_images(messages: list[dict[str, Any]], limits: MediaLimits) -> list[ImagePart]:
    """Every image part in order; BadInput for a malformed one, TooLarge past --max-images-per-request."""
    found: list[ImagePart] = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind in VIDEO_AND_AUDIO:
                raise BadInput(f"{where}: {kind!r} parts are not supported (hsx takes images: image_url parts)")
            if kind not in IMAGE_PART_TYPES:
                continue
            found.append(ImagePart(i, j, image_url(part, where)))
            if len(found) > limits.max_images:
                raise TooLarge(f"{where}: more than --max-images-per-request {limits.max_images} images")
    return found


async def load_images(parts: list[ImagePart], limits: MediaLimits, decode=None) -> list:
    """The decoded images of `parts`, in order. `decode(fn, *args)` runs the decoding away from
    the event loop (a media executor; default: a thread)."""
    decode = decode or asyncio.to_thread

    async def one(part: ImagePart):
        data = await load_bytes(part.url, part.where, limits)
        return await decode(decode_image, data, part.where, limits)

    return list(await asyncio.gather(*(one(p) for p in parts)))

"""The image and video parts of a chat: found, counted, named, and loaded.

An OpenAI image part is `{"type": "image_url", "image_url": {"url": ...}}`, a video part
`{"type": "video_url", "video_url": {"url": ...}}` (the url may also be given directly as a
string, as some datasets write it). Each is named by its place, `messages[i].content[j]`, in
every refusal.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from hsx_service.core.errors import BadInput, TooLarge
from hsx_service.media.decode import decode_image
from hsx_service.media.limits import MediaLimits
from hsx_service.media.sources import load_bytes
from hsx_service.media.video import decode_video

IMAGE_PART_TYPES = ("image_url", "input_image")  # the Chat Completions and the Responses API names
VIDEO_PART_TYPES = ("video_url",)
REFUSED = ("input_audio", "audio_url", "input_file", "file")


@dataclass(frozen=True)
class MediaPart:
    message: int
    part: int
    url: str
    kind: str = "image"  # or "video"

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"


def part_url(part: dict[str, Any], where: str, kind: str = "image") -> str:
    value = part.get(f"{kind}_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        article = "an" if kind == "image" else "a"
        raise BadInput(f"{where}: {article} {kind}_url part needs {kind}_url.url, a non-empty string")
    return url


def find_media(messages: list[dict[str, Any]], limits: MediaLimits) -> list[MediaPart]:
    """Every image and video part in order; BadInput for a malformed one or an audio / file
    part, TooLarge past --max-images-per-request or --max-videos-per-request."""
    found: list[MediaPart] = []
    counts = {"image": 0, "video": 0}
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind in REFUSED:
                raise BadInput(f"{where}: {kind!r} parts are not supported (hsx takes image_url parts, and "
                               "video_url parts for a model that takes video)")
            media = "image" if kind in IMAGE_PART_TYPES else "video" if kind in VIDEO_PART_TYPES else None
            if media is None:
                continue
            found.append(MediaPart(i, j, part_url(part, where, media), media))
            counts[media] += 1
            if counts["image"] > limits.max_images:
                raise TooLarge(f"{where}: more than --max-images-per-request {limits.max_images} images")
            if counts["video"] > limits.max_videos:
                raise TooLarge(f"{where}: more than --max-videos-per-request {limits.max_videos} videos")
    return found


async def load_media(parts: list[MediaPart], limits: MediaLimits, decode=None) -> list:
    """The decoded images (PIL) and videos (video.Video) of `parts`, in order. `decode(fn, *args)`
    runs the decoding away from the event loop (a media executor; default: a thread)."""
    decode = decode or asyncio.to_thread

    async def one(part: MediaPart):
        data = await load_bytes(part.url, part.where, limits, part.kind)
        return await decode(decode_video if part.kind == "video" else decode_image, data, part.where, limits)

    return list(await asyncio.gather(*(one(p) for p in parts)))

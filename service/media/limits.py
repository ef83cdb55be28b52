"""The operator's bounds on request media (each a ServiceSettings field, so a flag and an
HSX_* variable), gathered in one value the media code takes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MediaLimits:
    max_images: int = 8  # images in one request
    max_image_bytes: int = 20 << 20  # encoded bytes of one image (data URI decoded, file or download)
    max_image_pixels: int = 40_000_000  # width x height of one image, read from its header
    max_videos: int = 1  # videos in one request (a model that takes video)
    max_video_bytes: int = 64 << 20  # encoded bytes of one video
    max_video_frames: int = 32  # frames of one video, from its header
    max_video_pixels: int = 100_000_000  # frames x width x height of one video, from its header
    allowed_dir: Path | None = None  # local paths and file:// URLs only below it; None: refused
    allow_remote: bool = False  # http(s) URLs: the server fetches them (see docs/security.md)
    remote_timeout: float = 10.0  # seconds one download may take, connect to last byte

    @classmethod
    def from_settings(cls, settings) -> "MediaLimits":
        directory = settings.allowed_media_dir
        return cls(
            max_images=settings.max_images_per_request, max_image_bytes=settings.max_image_bytes,
            max_image_pixels=settings.max_image_pixels, max_videos=settings.max_videos_per_request,
            max_video_bytes=settings.max_video_bytes, max_video_frames=settings.max_video_frames,
            max_video_pixels=settings.max_video_pixels,
            allowed_dir=Path(directory).resolve(strict=True) if directory else None,
            allow_remote=settings.allow_remote_media, remote_timeout=settings.remote_media_timeout,
        )

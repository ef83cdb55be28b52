"""Encoded video bytes to decoded RGB frames and the metadata vLLM's video processors take,
refusing what is hostile before the cost.

Order: the container from the first bytes (MP4/MOV, WebM/Matroska, AVI; anything else, e.g.
an HLS or concat playlist that would make FFmpeg open other files or URLs, never reaches
FFmpeg); the frame size, count and rate from the container's header (OpenCV's FFmpeg
backend reading from memory, opened as vLLM's own video loader opens it), checked against
the operator's limits; only then the frames, at most the header's count, where a truncated
or corrupt stream fails and is refused. Every frame is kept (no sampling): a client that
wants fewer frames sends fewer, so the tokens it gets are the tokens it sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hsx_service.core.errors import BadInput, TooLarge
from hsx_service.media.limits import MediaLimits

CONTAINERS = "MP4/MOV, WebM/Matroska, AVI"
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"wide", b"free", b"skip")  # an ISO/QuickTime file's first box


@dataclass(frozen=True)
class Video:
    frames: Any  # uint8 array (frames, height, width, 3), RGB
    metadata: dict  # vLLM's video metadata (its opencv loader's keys)

    @property
    def item(self) -> tuple:
        """What vLLM's multi_modal_data["video"] takes for a model whose processor wants metadata."""
        return self.frames, self.metadata


def sniff_container(data: bytes) -> str | None:
    if data[4:8] in _MP4_BOXES:
        return "MP4"
    if data[:4] == b"\x1a\x45\xdf\xa3":  # EBML
        return "Matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "AVI"
    return None


def _open_capture(data: bytes):
    """A capture reading `data` from memory, opened as vLLM's opencv loader opens it (the first
    stream-buffered backend OpenCV has; FFmpeg in opencv-python's builds). hsx's own copy: vLLM's
    loader is an internal module that moves between releases."""
    import io

    import cv2
    from cv2 import videoio_registry as registry

    backends = [b for b in registry.getStreamBufferedBackends() if registry.hasBackend(b)]
    if not backends:
        raise ValueError("this OpenCV reads no video from memory")
    cap = cv2.VideoCapture(io.BytesIO(data), backends[0], [])
    if not cap.isOpened():
        raise ValueError("Could not open video stream")
    return cap


def decode_video(data: bytes, where: str, limits: MediaLimits) -> Video:
    """Every frame of `data` within the limits, or BadInput / TooLarge naming `where`."""
    fmt = sniff_container(data)
    if fmt is None:
        raise BadInput(f"{where}: not a video in a supported container ({CONTAINERS})")
    import cv2
    import numpy as np

    try:
        cap = _open_capture(data)
    except (ValueError, cv2.error) as exc:
        raise BadInput(f"{where}: the {fmt} video cannot be read ({exc})") from None
    # No cap.release(): on a capture reading from memory it crashes OpenCV 5.1 (segfault); the
    # capture is freed with its last reference, as vLLM's own loader leaves it.
    width, height = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
    count, fps = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), float(cap.get(cv2.CAP_PROP_FPS))
    if width < 1 or height < 1 or count < 1:
        raise BadInput(f"{where}: the {fmt} video has no frames ({count} frames of {width}x{height})")
    if not (math.isfinite(fps) and fps > 0):  # the processor's time positions divide by it
        raise BadInput(f"{where}: the {fmt} video has no frame rate")
    if width * height > limits.max_image_pixels:
        raise TooLarge(f"{where}: a video frame is {width}x{height} = {width * height} pixels, over "
                       f"--max-image-pixels {limits.max_image_pixels}")
    if count > limits.max_video_frames:
        raise TooLarge(f"{where}: the video has {count} frames, over --max-video-frames "
                       f"{limits.max_video_frames} (sample it before sending)")
    if count * width * height > limits.max_video_pixels:
        raise TooLarge(f"{where}: the video is {count} frames of {width}x{height} = {count * width * height} "
                       f"pixels, over --max-video-pixels {limits.max_video_pixels}")
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for k in range(count):  # never past the header's count, whatever the stream holds
        ok, frame = cap.read()
        if not ok or frame is None:
            raise BadInput(f"{where}: the {fmt} video is truncated or corrupt (frame {k} of {count} "
                           "cannot be decoded)")
        if frame.shape != (height, width, 3):
            raise BadInput(f"{where}: the {fmt} video's frame {k} is {frame.shape[1]}x{frame.shape[0]}, "
                           f"not the {width}x{height} of its header")
        cv2.cvtColor(frame, cv2.COLOR_BGR2RGB, dst=frames[k])
    # The keys and values of vLLM's own opencv loader for a video read whole (num_frames=-1).
    metadata = {"total_num_frames": count, "fps": fps, "duration": count / fps, "video_backend": "opencv",
                "frames_indices": list(range(count)), "do_sample_frames": True}
    return Video(frames, metadata)

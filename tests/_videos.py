"""Real video bytes for the media tests: short MP4s written by OpenCV's VideoWriter ('mp4v')
from matplotlib's sample photograph (or a gradient where matplotlib is absent), each frame
the photograph shifted, so that frames differ."""

from __future__ import annotations

import os
import tempfile

import _images as img


def _photo_bgr():
    import cv2
    import numpy as np

    data = img.photo()
    if data is not None:
        return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    ramp = np.linspace(0, 255, 256, dtype=np.uint8)
    return np.stack([np.tile(ramp, (256, 1)), np.tile(ramp[:, None], (1, 256)), np.full((256, 256), 90, np.uint8)], -1)


def mp4(width: int = 112, height: int = 84, frames: int = 4, fps: float = 2.0, shift: int = 7) -> bytes:
    """An MP4 (MPEG-4 part 2) of `frames` frames of width x height at `fps`."""
    import cv2
    import numpy as np

    base = cv2.resize(_photo_bgr(), (width, height), interpolation=cv2.INTER_AREA)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "v.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        assert writer.isOpened(), "OpenCV cannot write mp4v here"
        for k in range(frames):
            writer.write(np.roll(base, shift * k, axis=1))
        writer.release()
        with open(path, "rb") as f:
            return f.read()


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def data_uri(data: bytes) -> str:
    return img.data_uri(data, "video/mp4")

"""Encoded image bytes to a decoded RGB image, refusing what is hostile before the cost.

Order: the format from the first bytes (SVG and anything not a raster format below:
refused, nothing parsed); the size from the header alone (PIL's `Image.open` reads only
the header; a 20000 x 20000 PNG is 48 KB and 400 M pixels, refused here in microseconds);
only then the pixels, where a truncated or lying file fails decoding and is refused too.
"""

from __future__ import annotations

import io
import warnings
import zlib

from hsx_service.core.errors import BadInput, TooLarge
from hsx_service.media.limits import MediaLimits

# Raster formats hsx decodes (PIL's names). Formats PIL reads beside them (EPS runs
# Ghostscript; many are rare and little tested) are not offered to clients.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
          (b"BM", "BMP"))
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, zlib.error, IndexError, TypeError)


def sniff(data: bytes) -> str | None:
    """PIL's format name from the magic bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((name for magic, name in _MAGIC if data.startswith(magic)), None)


def _looks_like_svg(data: bytes) -> bool:
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return head.startswith((b"<svg", b"<?xml", b"<!doctype svg")) or b"<svg" in head


def decode_image(data: bytes, where: str, limits: MediaLimits):
    """A PIL RGB image of `data`, or BadInput / TooLarge naming `where`."""
    from PIL import Image

    fmt = sniff(data)
    if fmt is None:
        if _looks_like_svg(data):
            raise BadInput(f"{where}: SVG images are not accepted (send a raster image: {', '.join(FORMATS)})")
        raise BadInput(f"{where}: not an image in a supported format ({', '.join(FORMATS)})")
    with warnings.catch_warnings():
        # hsx's own pixel limit below decides; PIL's bomb warning (above 89 M pixels) is noise.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=[fmt])  # the header only
        except Image.DecompressionBombError as exc:
            # PIL's own guard (2 x Image.MAX_IMAGE_PIXELS), before hsx's limit could say it
            raise TooLarge(f"{where}: the image is too large for --max-image-pixels {limits.max_image_pixels} "
                           f"({exc})") from None
        except DECODE_ERRORS as exc:
            raise BadInput(f"{where}: the {fmt} image cannot be read ({_reason(exc)})") from None
        width, height = img.size
        if width < 1 or height < 1:
            raise BadInput(f"{where}: the {fmt} image has no pixels ({width}x{height})")
        if width * height > limits.max_image_pixels:
            raise TooLarge(f"{where}: the image is {width}x{height} = {width * height} pixels, over "
                           f"--max-image-pixels {limits.max_image_pixels}")
        try:
            img.load()  # a truncated or corrupt file fails here (LOAD_TRUNCATED_IMAGES stays off)
            return img.convert("RGB")
        except DECODE_ERRORS as exc:
            raise BadInput(f"{where}: the {fmt} image is truncated or corrupt ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__

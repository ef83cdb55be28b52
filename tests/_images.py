"""Real image bytes for the media tests: made with PIL, a photograph that matplotlib ships,
and hostile files built byte by byte (a PNG whose header claims 400 M pixels, truncated and
lying files)."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path


def png(width: int = 32, height: int = 24, color=(200, 30, 40)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def jpeg(width: int = 48, height: int = 32) -> bytes:
    from PIL import Image

    img = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def photo() -> bytes | None:
    """grace_hopper.jpg from matplotlib's sample data, when matplotlib is installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    return path.read_bytes() if path.exists() else None


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_bomb(side: int = 20000) -> bytes:
    """A real 1-bit grayscale PNG of side x side black pixels, its rows compressed as one
    stream: about 48 KB for 400 M pixels."""
    row = b"\x00" + b"\x00" * ((side + 7) // 8)  # filter byte + packed bits
    comp = zlib.compressobj(9)
    body = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def png_lying(claimed: int = 64, real: int = 8) -> bytes:
    """A PNG whose header says claimed x claimed but whose data holds real x real pixels."""
    raw = b"".join(b"\x00" + b"\x7f" * real * 3 for _ in range(real))
    ihdr = struct.pack(">IIBBBBB", claimed, claimed, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b"")


SVG = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>'


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}

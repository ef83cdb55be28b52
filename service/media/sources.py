"""An image part's URL to its encoded bytes, within the operator's limits.

Three sources: `data:` URIs (base64 or percent-encoded); local files, as a path or a
`file://` URL, only when the server was started with --allowed-media-dir and only inside
that directory once every symlink is resolved (a relative path is taken from it); http(s)
URLs only with --allow-remote-media, because they make the server fetch what a client
names (docs/security.md). Each read stops one byte past --max-image-bytes, so a large
file or download costs the cap, never its size.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import stat
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from hsx_service.core.errors import BadInput, TooLarge
from hsx_service.media.limits import MediaLimits


async def load_bytes(url: str, where: str, limits: MediaLimits) -> bytes:
    """The bytes `url` names; BadInput / TooLarge naming `where` (e.g. messages[0].content[1])."""
    if not isinstance(url, str) or not url:
        raise BadInput(f"{where}: image_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url[:12] else ""
    if scheme == "data":
        return data_uri_bytes(url, where, limits.max_image_bytes)
    if scheme in ("http", "https"):
        if not limits.allow_remote:
            raise BadInput(f"{where}: remote image URLs are off on this server (send the image as a data: URI; "
                           "the operator can allow downloads with --allow-remote-media)")
        return await download(url, where, limits)
    if scheme in ("", "file") or len(scheme) == 1:  # a bare path (a drive letter is no scheme)
        return await asyncio.to_thread(local_bytes, url, where, limits)
    raise BadInput(f"{where}: image URL scheme {scheme!r} is not supported (data:, file:// or a path, http(s))")


def data_uri_bytes(url: str, where: str, cap: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise BadInput(f"{where}: a data: URI needs a ',' before its data")
    if head.lower().endswith(";base64"):
        if len(payload) // 4 * 3 > cap + 3:  # refused before decoding a byte
            raise TooLarge(f"{where}: the image is over --max-image-bytes {cap} (about {len(payload) // 4 * 3} bytes)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadInput(f"{where}: the data: URI is not valid base64 ({exc})") from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > cap:
        raise TooLarge(f"{where}: the image is over --max-image-bytes {cap} ({len(data)} bytes)")
    return data


def local_path(url: str, where: str, limits: MediaLimits) -> Path:
    """The real path of a local image, inside --allowed-media-dir, or BadInput."""
    if limits.allowed_dir is None:
        raise BadInput(f"{where}: local image paths are off on this server (send the image as a data: URI; the "
                       "operator can allow a directory with --allowed-media-dir)")
    if url.lower().startswith("file:"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise BadInput(f"{where}: file:// URLs name no host (got {parts.netloc!r})")
        url = unquote(parts.path)
    if "\x00" in url:
        raise BadInput(f"{where}: the image path holds a NUL byte")
    path = Path(url)
    if not path.is_absolute():
        path = limits.allowed_dir / path
    real = Path(os.path.realpath(path))  # every symlink and '..' resolved
    if real != limits.allowed_dir and limits.allowed_dir not in real.parents:
        raise BadInput(f"{where}: the image path is outside --allowed-media-dir")
    return real


def local_bytes(url: str, where: str, limits: MediaLimits) -> bytes:
    real = local_path(url, where, limits)
    try:
        # O_NOFOLLOW: a last component swapped for a symlink after the check is refused.
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise BadInput(f"{where}: cannot open the image file ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory, FIFO or device
            raise BadInput(f"{where}: the image path is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limits.max_image_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > limits.max_image_bytes:
        raise TooLarge(f"{where}: the image file is over --max-image-bytes {limits.max_image_bytes}")
    return data


async def download(url: str, where: str, limits: MediaLimits) -> bytes:
    """GET `url` (no redirects: a redirect could lead the server anywhere), at most the cap."""
    import httpx

    cap = limits.max_image_bytes
    try:
        async with httpx.AsyncClient(timeout=limits.remote_timeout, follow_redirects=False) as client:
            async with asyncio.timeout(limits.remote_timeout):
                async with client.stream("GET", url) as resp:
                    if resp.status_code != 200:
                        raise BadInput(f"{where}: fetching the image URL answered HTTP {resp.status_code}")
                    declared = resp.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > cap:
                        raise TooLarge(f"{where}: the image URL's body is over --max-image-bytes {cap}")
                    chunks, size = [], 0
                    async for chunk in resp.aiter_raw():
                        size += len(chunk)
                        if size > cap:
                            raise TooLarge(f"{where}: the image URL's body is over --max-image-bytes {cap}")
                        chunks.append(chunk)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise BadInput(f"{where}: fetching the image URL failed ({type(exc).__name__}: {exc or 'timed out'})") from None
    return b"".join(chunks)

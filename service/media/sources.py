"""An image or video part's URL to its encoded bytes, within the operator's limits.

Three sources: `data:` URIs (base64 or percent-encoded); local files, as a path or a
`file://` URL, only when the server was started with --allowed-media-dir and only inside
that directory once every symlink is resolved (a relative path is taken from it); http(s)
URLs only with --allow-remote-media, because they make the server fetch what a client
names (docs/security.md). Each read stops one byte past the cap (--max-image-bytes, or
--max-video-bytes for a video), so a large file or download costs the cap, never its size.
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


def byte_cap(limits: MediaLimits, kind: str) -> tuple[int, str]:
    """The encoded-size cap of a `kind` ("image" or "video") and the flag that sets it."""
    if kind == "video":
        return limits.max_video_bytes, "--max-video-bytes"
    return limits.max_image_bytes, "--max-image-bytes"


async def load_bytes(url: str, where: str, limits: MediaLimits, kind: str = "image") -> bytes:
    """The bytes `url` names; BadInput / TooLarge naming `where` (e.g. messages[0].content[1])."""
    if not isinstance(url, str) or not url:
        raise BadInput(f"{where}: {kind}_url.url must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url[:12] else ""
    if scheme == "data":
        return data_uri_bytes(url, where, *byte_cap(limits, kind), kind=kind)
    if scheme in ("http", "https"):
        if not limits.allow_remote:
            raise BadInput(f"{where}: remote {kind} URLs are off on this server (send the {kind} as a data: URI; "
                           "the operator can allow downloads with --allow-remote-media)")
        return await download(url, where, limits, kind)
    if scheme in ("", "file") or len(scheme) == 1:  # a bare path (a drive letter is no scheme)
        return await asyncio.to_thread(local_bytes, url, where, limits, kind)
    raise BadInput(f"{where}: {kind} URL scheme {scheme!r} is not supported (data:, file:// or a path, http(s))")


def data_uri_bytes(url: str, where: str, cap: int, flag: str = "--max-image-bytes", kind: str = "image") -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise BadInput(f"{where}: a data: URI needs a ',' before its data")
    if head.lower().endswith(";base64"):
        if len(payload) // 4 * 3 > cap + 3:  # refused before decoding a byte
            raise TooLarge(f"{where}: the {kind} is over {flag} {cap} (about {len(payload) // 4 * 3} bytes)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadInput(f"{where}: the data: URI is not valid base64 ({exc})") from None
    else:
        data = unquote_to_bytes(payload)
    if len(data) > cap:
        raise TooLarge(f"{where}: the {kind} is over {flag} {cap} ({len(data)} bytes)")
    return data


def local_path(url: str, where: str, limits: MediaLimits, kind: str = "image") -> Path:
    """The real path of a local image or video, inside --allowed-media-dir, or BadInput."""
    if limits.allowed_dir is None:
        raise BadInput(f"{where}: local {kind} paths are off on this server (send the {kind} as a data: URI; the "
                       "operator can allow a directory with --allowed-media-dir)")
    if url.lower().startswith("file:"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise BadInput(f"{where}: file:// URLs name no host (got {parts.netloc!r})")
        url = unquote(parts.path)
    if "\x00" in url:
        raise BadInput(f"{where}: the {kind} path holds a NUL byte")
    path = Path(url)
    if not path.is_absolute():
        path = limits.allowed_dir / path
    real = Path(os.path.realpath(path))  # every symlink and '..' resolved
    if real != limits.allowed_dir and limits.allowed_dir not in real.parents:
        raise BadInput(f"{where}: the {kind} path is outside --allowed-media-dir")
    return real


def local_bytes(url: str, where: str, limits: MediaLimits, kind: str = "image") -> bytes:
    real = local_path(url, where, limits, kind)
    cap, flag = byte_cap(limits, kind)
    try:
        # O_NOFOLLOW: a last component swapped for a symlink after the check is refused.
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise BadInput(f"{where}: cannot open the {kind} file ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory, FIFO or device
            raise BadInput(f"{where}: the {kind} path is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise TooLarge(f"{where}: the {kind} file is over {flag} {cap}")
    return data


async def download(url: str, where: str, limits: MediaLimits, kind: str = "image") -> bytes:
    """GET `url` (no redirects: a redirect could lead the server anywhere), at most the cap."""
    import httpx

    cap, flag = byte_cap(limits, kind)
    try:
        async with httpx.AsyncClient(timeout=limits.remote_timeout, follow_redirects=False) as client:
            async with asyncio.timeout(limits.remote_timeout):
                async with client.stream("GET", url) as resp:
                    if resp.status_code != 200:
                        raise BadInput(f"{where}: fetching the {kind} URL answered HTTP {resp.status_code}")
                    declared = resp.headers.get("content-length", "")
                    if declared.isdigit() and int(declared) > cap:
                        raise TooLarge(f"{where}: the {kind} URL's body is over {flag} {cap}")
                    chunks, size = [], 0
                    async for chunk in resp.aiter_raw():
                        size += len(chunk)
                        if size > cap:
                            raise TooLarge(f"{where}: the {kind} URL's body is over {flag} {cap}")
                        chunks.append(chunk)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise BadInput(f"{where}: fetching the {kind} URL failed ({type(exc).__name__}: {exc or 'timed out'})") from None
    return b"".join(chunks)

"""Images in input rows: found, resolved when the rows are read, sent as `data:` URIs.

Where a row's images come from (each becomes an OpenAI part `{"type": "image_url",
"image_url": {"url": ...}}` in its message, in order):
  * OpenAI parts `image_url` (url an object's `url` or a string) and speculators'
    `{"type": "image", "path" | "url": ...}`;
  * the row's `image` / `images` field (LLaVA, ShareGPT-4V, Hugging Face datasets with an
    image column): a path, a list of them, or a datasets `Image` value (bytes); each fills
    the next `<image>` placeholder of a turn's text, or the next bare `{"type": "image"}`
    part; with no placeholder at all they go before the first user turn's text (LLaVA's rule).

Videos: OpenAI-style `{"type": "video_url", "video_url": {"url": ...}}` parts, resolved and
sent as image_url parts are (the server takes them for a model that takes video).

URLs: `data:` and `http(s)` pass as they are (a server refuses remote URLs unless its
operator allows them). A path (or `file://` URL) is taken from the input file's directory
when relative and must name a readable file when the row is read (else the row is a BadRow
naming it); it is kept as an absolute `file://` URL in the plan and read into a `data:` URI
only when the request is sent (`inline`), so a plan never holds every image of a dataset in
memory. Why data URIs and not paths the server reads: `hsx extract` fans out over servers on
other hosts and in containers, which share no filesystem with the client, and a server reads
paths only under its operator's `--allowed-media-dir`; an image is tens of kilobytes where
its sample's states are megabytes.
"""

from __future__ import annotations

import base64
import copy
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from hsx_client.corpus.rows import RowProblem

MISSING_IMAGE = "missing_image"  # BadRow kind
PLACEHOLDER = "<image>"
_PART_TYPES = ("image_url", "input_image")
VIDEO_PART = "video_url"
_MEDIA_TYPES = (*_PART_TYPES, VIDEO_PART)
_SIGNATURES = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
               (b"BM", "image/bmp"), (b"\x1a\x45\xdf\xa3", "video/webm"))


class ImageFileError(ValueError):
    """An image file the plan names can no longer be read (moved or deleted since)."""


def mime_of(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[4:8] == b"ftyp":
        return "video/mp4"
    return next((m for sig, m in _SIGNATURES if data.startswith(sig)), "application/octet-stream")


def data_uri(data: bytes) -> str:
    return f"data:{mime_of(data)};base64," + base64.b64encode(data).decode("ascii")


def undecoded(ds: Any) -> Any:
    """An image column read as its stored bytes and path, not decoded to pixels (the
    server decodes; re-encoding a JPEG here would change it)."""
    import datasets

    for name, feature in (getattr(ds, "features", None) or {}).items():
        if isinstance(feature, datasets.Image) and feature.decode:
            ds = ds.cast_column(name, datasets.Image(decode=False))
    return ds


def source_dir(spec: str) -> Path | None:
    """Where a source's relative image paths start: a file's directory, a dataset
    directory itself; None for a hub dataset."""
    if spec.startswith("hf:"):
        return None
    path = Path(spec).resolve()
    return path if path.is_dir() else path.parent


def row_images(row: dict) -> list[Any]:
    """The images of a row's `image` / `images` field, in order (none, or empty as text rows of
    mixed datasets have them: [])."""
    value = row.get("images", row.get("image"))
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if v is not None and v != ""]


def _file_url(path: str, where: str, base: Path | None, kind: str = "image") -> str:
    if path.lower().startswith("file:"):
        parts = urlsplit(path)
        if parts.netloc not in ("", "localhost"):
            raise RowProblem(f"{where}: file:// URLs name no host (got {parts.netloc!r})")
        path = unquote(parts.path)
    p = Path(path).expanduser()
    if not p.is_absolute():
        if base is None:
            raise RowProblem(f"{where}: relative {kind} path {path!r} in a hub dataset (give absolute paths or bytes)")
        p = base / p
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):
            raise RowProblem(f"{where}: {kind} path {str(p)!r} is not a file", MISSING_IMAGE)
    except OSError:
        raise RowProblem(f"{where}: {kind} file not found: {p}", MISSING_IMAGE) from None
    return "file://" + quote(os.path.abspath(p))


def _url_of(value: Any, where: str, base: Path | None, kind: str = "image") -> str:
    """One image (video) reference as the URL the plan keeps."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):  # a datasets Image, undecoded
        if value.get("bytes"):
            return data_uri(bytes(value["bytes"]))
        value = value.get("path")
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image (a decoded datasets Image)
        import io

        buf = io.BytesIO()
        value.save(buf, "PNG")
        return data_uri(buf.getvalue())
    if not isinstance(value, str) or not value.strip():
        raise RowProblem(f"{where}: an image must be a path, a URL or image bytes, got {type(value).__name__}")
    scheme = value.split(":", 1)[0].lower() if ":" in value[:12] else ""
    if scheme in ("data", "http", "https"):
        return value
    return _file_url(value, where, base, kind)


def _given_url(value: Any, field: str, where: str) -> str:
    """The URL an OpenAI media part gives in `field` (an object with `url`, or the URL itself)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        article = "an" if field == "image_url" else "a"
        raise RowProblem(f"{where}: {article} {field} part needs {field}.url, a non-empty string")
    return url


def _part_url(part: dict, where: str, base: Path | None, given: list[Any]) -> str:
    if part.get("type") in _PART_TYPES:
        return _url_of(_given_url(part.get("image_url", part.get("image")), "image_url", where), where, base)
    for key in ("path", "url", "image"):  # speculators' and transformers' image parts
        if part.get(key) is not None:
            return _url_of(part[key], where, base)
    if not given:
        raise RowProblem(f"{where}: an image part with no path or URL, and the row has no more images")
    return _url_of(given.pop(0), where, base)


def _split_placeholders(text: str, where: str, base: Path | None, given: list[Any]) -> list[dict]:
    parts: list[dict] = []
    for k, piece in enumerate(text.split(PLACEHOLDER)):
        if k:
            if not given:
                raise RowProblem(f"{where}: more {PLACEHOLDER} placeholders than images in the row")
            parts.append(image_part(_url_of(given.pop(0), where, base)))
        piece = piece.strip("\n") if k or piece.strip() == "" else piece
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": VIDEO_PART, VIDEO_PART: {"url": url}}


def _video_url(part: dict, where: str, base: Path | None) -> str:
    return _url_of(_given_url(part.get(VIDEO_PART), VIDEO_PART, where), where, base, "video")


def resolve(messages: list[dict], row: dict, base: Path | None) -> list[dict]:
    """`messages` with every image as an `image_url` part whose URL the plan keeps (module
    doc); RowProblem naming the message and part for a missing file or a bad reference."""
    given = row_images(row)
    n_given = len(given)
    has_placeholder = bool(given) and any(isinstance(m.get("content"), str) and PLACEHOLDER in m["content"]
                                          for m in messages)
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == VIDEO_PART:
                    parts.append(video_part(_video_url(part, f"messages[{i}].content[{j}]", base)))
                    continue
                is_image = isinstance(part, dict) and (part.get("type") in _PART_TYPES or part.get("type") == "image")
                parts.append(image_part(_part_url(part, f"messages[{i}].content[{j}]", base, given))
                             if is_image else part)
            m = {**m, "content": parts}
        elif isinstance(content, str) and has_placeholder and PLACEHOLDER in content:
            m = {**m, "content": _split_placeholders(content, f"messages[{i}]", base, given)}
        out.append(m)
    if given and not has_placeholder and len(given) == n_given:  # LLaVA: the images open the first user turn
        first = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        if first is None:
            raise RowProblem("the row has images and no user turn to show them in")
        text = out[first]["content"]
        rest = text if isinstance(text, list) else [{"type": "text", "text": text}]
        urls = [image_part(_url_of(v, f"image[{k}]", base)) for k, v in enumerate(given)]
        out[first] = {**out[first], "content": [*urls, *rest]}
        given.clear()
    if given:
        raise RowProblem(f"the row has {n_given} images and only {n_given - len(given)} places for them "
                         f"({PLACEHOLDER} placeholders or image parts)")
    return out


def _any_part(messages: Any, test: Callable[[dict], bool]) -> bool:
    """Whether any content part (a dict in a message's list content) of `messages` passes `test`."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and test(p) for p in m["content"])
        for m in messages)


def has_images(row: dict) -> bool:
    if row_images(row):
        return True
    msgs = row.get("messages") or row.get("conversations") or []
    return _any_part(msgs, lambda p: p.get("type") in _MEDIA_TYPES or p.get("type") == "image")


def request_has_images(body: dict) -> bool:
    """A planned request (messages with image or video parts, as extract plans image chats)."""
    return _any_part(body.get("messages"), lambda p: p.get("type") in _MEDIA_TYPES)


def remote_images(body: dict) -> bool:
    """A request with an image or video at an http(s) URL (its server fetches it, when allowed)."""
    return _any_part(body.get("messages"), lambda p: p.get("type") in _MEDIA_TYPES
                     and str(_url(p)).lower().startswith(("http://", "https://")))


def _url(part: dict) -> Any:
    value = part.get(VIDEO_PART) if part.get("type") == VIDEO_PART else part.get("image_url", part.get("image"))
    return value.get("url", "") if isinstance(value, dict) else value


def _file_parts(messages: Any) -> Iterator[tuple[dict, str, str]]:
    """(part, its URL's key, the URL) of every image or video part at a `file://` URL."""
    for m in messages or ():
        for part in m.get("content") if isinstance(m, dict) and isinstance(m.get("content"), list) else ():
            key = VIDEO_PART if isinstance(part, dict) and part.get("type") == VIDEO_PART else "image_url"
            url = (part.get(key) or {}).get("url", "") if isinstance(part, dict) else ""
            if isinstance(url, str) and url.startswith("file://"):
                yield part, key, url


def local_media_paths(body: dict) -> list[tuple[str, Path]]:
    """(url, path) of every `file://` image or video of a planned request, as `inline` reads them."""
    return [(url, Path(unquote(urlsplit(url).path))) for _, _, url in _file_parts(body.get("messages"))]


def needs_inlining(body: dict) -> bool:
    return next(_file_parts(body.get("messages")), None) is not None


def inline(body: dict) -> dict:
    """`body` with every `file://` image or video read into a `data:` URI (a copy; `body` is
    kept); ImageFileError when a file can no longer be read."""
    if not needs_inlining(body):
        return body
    out = dict(body, messages=copy.deepcopy(body["messages"]))
    for part, key, url in list(_file_parts(out["messages"])):
        path = unquote(urlsplit(url).path)
        try:
            part[key] = {**part[key], "url": data_uri(Path(path).read_bytes())}
        except OSError as exc:
            raise ImageFileError(f"{'video' if key == VIDEO_PART else 'image'} file {path}: {exc.strerror or exc} "
                                 "(moved or deleted since the plan was made)") from None
    return out


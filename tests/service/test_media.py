"""Issue 38, first slice: image parts to decoded images within the operator's limits, and
every hostile input (a 400 M-pixel PNG, truncated and lying files, SVG, unknown formats,
paths out of --allowed-media-dir, remote URLs while off) refused fast, naming its part."""

from __future__ import annotations

import asyncio
import http.server
import os
import threading
import time
from dataclasses import replace

import pytest

import _images as img
from hsx_service.core.errors import BadInput, TooLarge
from hsx_service.http.errors import status_of
from hsx_service.media.decode import decode_image
from hsx_service.media.limits import MediaLimits
from hsx_service.media.parts import find_media, load_media

LIMITS = MediaLimits(max_images=4, max_image_bytes=1 << 20, max_image_pixels=4_000_000)
WHERE = "messages[0].content[1]"


def decode(data: bytes, limits: MediaLimits = LIMITS):
    return decode_image(data, WHERE, limits)


def load(urls: list[str], limits: MediaLimits = LIMITS) -> list:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, *map(img.image_part, urls)]}]
    return asyncio.run(load_media(find_media(messages, limits), limits))


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return img.png_bomb()


# ------------------------------------------------------------------------------ decoding
@pytest.mark.parametrize("data, size", [(img.png(32, 24), (32, 24)), (img.jpeg(48, 32), (48, 32))])
def test_png_and_jpeg_decode_to_rgb(data, size):
    out = decode(data)
    assert out.mode == "RGB" and out.size == size


def test_a_photograph_decodes():
    data = img.photo()
    if data is None:
        pytest.skip("matplotlib's sample photograph is not installed")
    out = decode(data)
    assert out.size == (512, 600) and out.mode == "RGB"


def test_a_400_megapixel_png_is_refused_from_its_header_in_milliseconds(bomb):
    assert len(bomb) < 64 * 1024
    t = time.perf_counter()
    for limit in (40_000_000, 300_000_000):  # under and over PIL's own bomb guard (179 M)
        with pytest.raises(TooLarge, match=r"messages\[0\]\.content\[1\]: the image is .*"
                                           f"--max-image-pixels {limit}.*400000000 pixels|400000000 pixels, over "
                                           f"--max-image-pixels {limit}"):
            decode(bomb, replace(LIMITS, max_image_pixels=limit))
    assert time.perf_counter() - t < 0.05


def test_pixel_limit_is_the_operators():
    data = img.png(100, 100)
    assert decode(data, replace(LIMITS, max_image_pixels=10_000)).size == (100, 100)
    with pytest.raises(TooLarge, match="10000 pixels, over --max-image-pixels 9999"):
        decode(data, replace(LIMITS, max_image_pixels=9_999))


@pytest.mark.parametrize("name, data, message", [
    ("truncated png", img.png(64, 64)[:-40], "truncated or corrupt|cannot be read"),
    ("truncated jpeg", img.jpeg(256, 256)[:300], "truncated or corrupt|cannot be read"),
    ("lying png", img.png_lying(), "truncated or corrupt"),
    ("svg", img.SVG, "SVG images are not accepted"),
    ("text", b"hello, not an image at all", "not an image in a supported format"),
    ("tiff", b"II*\x00" + b"\x00" * 64, "not an image in a supported format"),
    ("empty", b"", "not an image in a supported format"),
    ("png header only", img.png()[:30], "cannot be read|truncated"),
])
def test_hostile_images_are_a_400_naming_the_part_fast(name, data, message):
    t = time.perf_counter()
    with pytest.raises(BadInput, match=message) as info:
        decode(data)
    assert info.value.message.startswith(WHERE + ": ")
    assert status_of(info.value) == 400
    assert time.perf_counter() - t < 0.05, name


# ------------------------------------------------------------------------------ data URIs
def test_data_uris_of_several_images_load_in_order():
    out = load([img.data_uri(img.png(10, 20)), img.data_uri(img.jpeg(30, 40), "image/jpeg")])
    assert [i.size for i in out] == [(10, 20), (30, 40)]


def test_data_uri_over_the_byte_cap_is_refused_before_decoding():
    big = img.data_uri(b"\x00" * (2 << 20))
    with pytest.raises(TooLarge, match=r"messages\[0\]\.content\[1\]: the image is over --max-image-bytes"):
        load([big])


def test_bad_base64_and_too_many_images():
    with pytest.raises(BadInput, match=r"content\[1\]: the data: URI is not valid base64"):
        load(["data:image/png;base64,@@@@"])
    with pytest.raises(TooLarge, match=r"messages\[0\]\.content\[5\]: more than --max-images-per-request 4"):
        load([img.data_uri(img.png())] * 5)


def test_malformed_parts_are_named():
    with pytest.raises(BadInput, match=r"messages\[1\]\.content\[0\]: an image_url part needs image_url.url"):
        find_media([{"role": "user", "content": "hi"},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], LIMITS)
    with pytest.raises(BadInput, match="scheme 'ftp' is not supported"):
        load(["ftp://example.com/a.png"])


# ------------------------------------------------------------------------------ local files
@pytest.fixture
def media_dir(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "a.png").write_bytes(img.png(7, 9))
    (tmp_path / "secret.png").write_bytes(img.png(5, 5))
    os.symlink(tmp_path / "secret.png", allowed / "out.png")
    os.symlink(allowed / "sub" / "a.png", allowed / "in.png")
    return allowed


def test_local_paths_inside_the_allowed_dir_load(media_dir):
    limits = replace(LIMITS, allowed_dir=media_dir.resolve())
    urls = ["sub/a.png", str(media_dir / "sub" / "a.png"), (media_dir / "sub" / "a.png").as_uri(), "in.png"]
    assert [i.size for i in load(urls, limits)] == [(7, 9)] * 4


@pytest.mark.parametrize("url", ["../secret.png", "sub/../../secret.png", "out.png", "{tmp}/secret.png",
                                 "file://{tmp}/secret.png", "/etc/passwd", "file:///etc/passwd"])
def test_nothing_outside_the_allowed_dir(media_dir, url):
    limits = replace(LIMITS, allowed_dir=media_dir.resolve())
    with pytest.raises(BadInput, match=r"content\[1\]: the image path is outside --allowed-media-dir"):
        load([url.format(tmp=media_dir.parent)], limits)


def test_local_paths_are_off_without_an_allowed_dir(media_dir):
    with pytest.raises(BadInput, match="local image paths are off on this server"):
        load([str(media_dir / "sub" / "a.png")])


def test_missing_files_directories_and_devices(media_dir):
    limits = replace(LIMITS, allowed_dir=media_dir.resolve())
    with pytest.raises(BadInput, match="cannot open the image file"):
        load(["nope.png"], limits)
    with pytest.raises(BadInput, match="not a regular file"):
        load(["sub"], limits)


def test_a_file_over_the_byte_cap(media_dir):
    (media_dir / "big.png").write_bytes(img.png() + b"\x00" * (2 << 20))
    with pytest.raises(TooLarge, match="over --max-image-bytes"):
        load(["big.png"], replace(LIMITS, allowed_dir=media_dir.resolve()))


# ------------------------------------------------------------------------------ remote URLs
@pytest.fixture(scope="module")
def image_site():
    """A local HTTP server: /small.png, /big (over the cap), /slow (never answers in time)."""
    small, big = img.png(11, 13), img.png() + b"\x00" * (2 << 20)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow":
                time.sleep(1.5)
            body = {"/small.png": small, "/big": big}.get(self.path, b"x")
            self.send_response(200 if self.path != "/missing" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client stopped at its cap or timeout
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_urls_are_refused_unless_allowed(image_site):
    with pytest.raises(BadInput, match="remote image URLs are off on this server"):
        load([image_site + "/small.png"])
    on = replace(LIMITS, allow_remote=True, remote_timeout=0.5)
    assert load([image_site + "/small.png"], on)[0].size == (11, 13)
    with pytest.raises(TooLarge, match="over --max-image-bytes"):
        load([image_site + "/big"], on)
    with pytest.raises(BadInput, match="answered HTTP 404"):
        load([image_site + "/missing"], on)
    t = time.perf_counter()
    with pytest.raises(BadInput, match="fetching the image URL failed"):
        load([image_site + "/slow"], on)
    assert time.perf_counter() - t < 1.2


def test_audio_and_file_parts_are_refused_by_name():
    for kind in ("input_audio", "audio_url", "input_file", "file"):
        with pytest.raises(BadInput, match=rf"messages\[0\]\.content\[1\]: '{kind}' parts are not supported"):
            find_media([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": kind}]}], LIMITS)

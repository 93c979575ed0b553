"""Images in-process (`serving/images.py`, `serving/image_sources.py`): every format Pillow
decodes, as decoded (EXIF orientation applied, an animation's first frame, the mode kept), the
content hash over pixels rather than bytes, and every refusal a 400 naming the part: the count
in vLLM's words, a header's pixel count before any decoding, bytes, media types, base64, URL
schemes, and fetches from a real HTTP server on loopback (a 404, a redirect elsewhere, a body
past the cap, a stall)."""

from __future__ import annotations

import asyncio
import base64
import io
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from image_files import png_header
from PIL import Image
from sse_server import serving

from nanoserve.entrypoints.serving.chat_input import ContentPart, MessageInput
from nanoserve.entrypoints.serving.errors import APIError
from nanoserve.entrypoints.serving.image_sources import NOT_ENABLED
from nanoserve.entrypoints.serving.images import DecodedImage, decode_image, load_images
from nanoserve.server_config import ImageLimits, parse_mm_limits

WHERE = "messages.0.content.1"
LIMITS = ImageLimits()


def pixels(width: int = 16, height: int = 12, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A small image of noise from `seed` (so encodings differ and compress badly)."""
    size = width * height * len(mode)
    return Image.frombytes(mode, (width, height), random.Random(seed).randbytes(size))


def encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def as_data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"




def decoded(data: bytes, max_pixels: int = LIMITS.max_pixels) -> DecodedImage:
    return decode_image(data, WHERE, max_pixels)


def refusal(call: Callable[[], Any]) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


def load(urls: list[str | None], limits: ImageLimits = LIMITS,
         accepts_images: bool = True) -> list[DecodedImage]:
    """`urls` as one user turn's image parts after a text part, through `load_images`."""
    parts = (ContentPart("text", "Look:"),
             *(ContentPart("image", image_url=url) for url in urls))
    return asyncio.run(load_images([MessageInput("user", parts)], limits, accepts_images))


# decoding --------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "options", "mode"), [
    ("PNG", {}, "RGB"), ("JPEG", {"quality": 90}, "RGB"), ("WEBP", {"quality": 80}, "RGB"),
    ("WEBP", {"lossless": True}, "RGB"), ("GIF", {}, "P"), ("BMP", {}, "RGB"),
    ("TIFF", {}, "RGB")])
def test_each_format_decodes_to_its_size(fmt: str, options: dict[str, Any], mode: str) -> None:
    image = decoded(encoded(pixels(), fmt, **options))
    assert image.image.size == (16, 12) and image.image.mode == mode
    assert image.where == WHERE and len(image.content_hash) == 16


def test_modes_are_kept_as_decoded() -> None:
    """RGBA keeps its alpha, a palette stays a palette, grey stays grey: the model's processor
    converts to RGB as transformers does, so nothing is converted twice."""
    for mode in ("RGBA", "L", "LA"):
        assert decoded(encoded(pixels(mode=mode), "PNG")).image.mode == mode
    palette = pixels().convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    assert decoded(encoded(palette, "PNG")).image.mode == "P"


def test_an_animation_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    assert Image.open(io.BytesIO(gif)).n_frames == 2  # a real animation
    image = decoded(gif).image
    assert image.convert("RGB").getpixel((4, 4)) == (255, 0, 0)
    assert getattr(image, "n_frames", 1) == 1  # a frame, not the file


def test_exif_orientation_is_applied() -> None:
    """A phone's portrait photo is stored landscape with orientation 6 (rotate 90 degrees
    clockwise to view): decoded, it stands upright, as every viewer shows it."""
    wide = Image.new("RGB", (40, 20), (255, 255, 255))
    wide.paste((255, 0, 0), (0, 0, 10, 20))  # a red band on the left
    exif = Image.Exif()
    exif[0x0112] = 6
    image = decoded(encoded(wide, "JPEG", quality=95, exif=exif)).image
    assert image.size == (20, 40)
    red, green, blue = image.getpixel((10, 5))  # the band is on top now
    assert red > 200 and green < 60 and blue < 60, (red, green, blue)


# the content hash -----------------------------------------------------------------------


def test_the_hash_is_of_pixels_not_bytes() -> None:
    """A PNG and a lossless WebP of the same pixels hash equal (a client that re-encodes a
    screenshot still hits the caches); one changed pixel, or another palette over the same
    indices, hashes differently."""
    image = pixels()
    png, webp = decoded(encoded(image, "PNG")), decoded(encoded(image, "WEBP", lossless=True))
    assert encoded(image, "PNG") != encoded(image, "WEBP", lossless=True)
    assert png.content_hash == webp.content_hash
    changed = image.copy()
    changed.putpixel((3, 3), (0, 0, 0) if image.getpixel((3, 3)) != (0, 0, 0) else (1, 1, 1))
    assert decoded(encoded(changed, "PNG")).content_hash != png.content_hash
    assert decoded(encoded(pixels(seed=1), "PNG")).content_hash != png.content_hash
    grey = Image.new("P", (4, 4), 0)
    grey.putpalette([128, 128, 128] * 256)
    red = Image.new("P", (4, 4), 0)
    red.putpalette([255, 0, 0] * 256)
    assert decoded(encoded(grey, "PNG")).content_hash != decoded(encoded(red, "PNG")).content_hash


# refusals while decoding ----------------------------------------------------------------


def test_undecodable_bytes_are_a_400_naming_the_part() -> None:
    png = encoded(pixels(64, 64), "PNG")
    for data in (png[:len(png) // 2], b"not an image at all", b"", png[:8] + b"\0" * 40):
        error = refusal(lambda data=data: decoded(data))
        assert error.param == WHERE
        assert error.message.startswith(f"{WHERE} could not be decoded as an image: "), error


def test_too_many_pixels_is_refused_from_the_header() -> None:
    """The size is read before any pixel: a 20,000 x 20,000 PNG header with no pixel data
    behind it is refused as too large (decoding would have failed, and cost 1.6 GB)."""
    error = refusal(lambda: decoded(png_header(20_000, 20_000)))
    assert error.param == WHERE and "at most 50,000,000 pixels" in error.message, error
    assert "--max-image-pixels" in error.message
    error = refusal(lambda: decoded(png_header(8_000, 8_000)))
    assert "is 8000x8000 (64,000,000 pixels); at most 50,000,000" in error.message, error
    small = refusal(lambda: decoded(encoded(pixels(), "PNG"), max_pixels=100))
    assert "is 16x12 (192 pixels); at most 100 pixels are allowed" in small.message


# data URLs and the count ------------------------------------------------------------------


def test_data_urls_with_and_without_a_media_type() -> None:
    png = encoded(pixels(), "PNG")
    b64 = base64.b64encode(png).decode()
    wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))  # as `base64` wraps
    urls: list[str | None] = [as_data_url(png), f"data:;base64,{b64}",
                              f"data:image/png;base64,{wrapped}",
                              f"data:image/png;base64,{b64.rstrip('=')}"]
    images = load(urls)
    assert [image.where for image in images] == [f"messages.0.content.{j}" for j in (1, 2, 3, 4)]
    assert len({image.content_hash for image in images}) == 1


@pytest.mark.parametrize(("url", "says"), [
    (as_data_url(b"hello", "text/plain"),
     "the data URL's media type 'text/plain' is not an image's; send image/png"),
    ("data:image/png;base64,!!!not-base64!!!", "the data URL's base64 is invalid"),
    ("data:image/png,%89PNG", "a data URL must carry base64"),
    ("data:image/png;base64", "a data URL needs a comma"),
    (None, "has no image URL"),
    ("", "has no image URL"),
    ("file:///etc/passwd", "the URL must be either a HTTP or data URL (http:, https: or data:)"),
    ("ftp://example.com/a.png", "the URL must be either a HTTP or data URL"),
    ("https://example.com/cat.png", NOT_ENABLED),
])
def test_bad_urls_are_a_400_naming_the_part(url: str | None, says: str) -> None:
    png = as_data_url(encoded(pixels(), "PNG"))
    error = refusal(lambda: load([png, url]))
    assert error.param == "messages.0.content.2" and says in error.message, error


def test_bytes_past_the_cap_are_refused_before_decoding() -> None:
    url = as_data_url(encoded(pixels(64, 64), "PNG"))
    error = refusal(lambda: load([url], ImageLimits(max_bytes=1000)))
    assert "over 1,000 bytes (--max-image-bytes)" in error.message, error


def test_the_count_in_vllms_words() -> None:
    url = as_data_url(encoded(pixels(), "PNG"))
    error = refusal(lambda: load([url, url, url], ImageLimits(max_images=2)))
    assert error.message == ("At most 2 image(s) may be provided in one prompt. Set "
                             "--limit-mm-per-prompt to increase this limit.")
    assert error.param == "messages.0.content.3"  # the first one past the limit
    text_only = refusal(lambda: load(["garbage that is never read"], accepts_images=False))
    assert text_only.message == "At most 0 image(s) may be provided in one prompt."
    assert text_only.param == "messages.0.content.1"
    assert load([url, url], ImageLimits(max_images=2))  # at the limit: taken


@pytest.mark.parametrize(("flag", "count"), [
    ('{"image": 4}', 4), ('{"image": 2, "video": 0}', 2), ('{"image": {"count": 3}}', 3),
    ("image=5,video=0", 5), ('{"video": 0}', 999)])
def test_limit_mm_per_prompt_reads_vllms_forms(flag: str, count: int) -> None:
    assert parse_mm_limits(flag) == count


@pytest.mark.parametrize("flag", ['{"video": 2}', "[4]", "four", '{"image": "many"}'])
def test_limit_mm_per_prompt_refuses_what_it_cannot_keep(flag: str) -> None:
    with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
        parse_mm_limits(flag)


# fetching from a real server on loopback ---------------------------------------------------

PNG = encoded(pixels(), "PNG")


async def routes(request: web.Request) -> web.StreamResponse:
    """/cat.png, /missing (404), /moved (to /cat.png), /away (to another host name), /big
    (a body past the cap with no Content-Length), /slow (no answer for 1 s)."""
    path = request.path
    if path == "/cat.png":
        return web.Response(body=PNG, content_type="image/png")
    if path == "/moved":
        raise web.HTTPFound("/cat.png")
    if path == "/away":
        raise web.HTTPFound(f"http://localhost:{request.url.port}/cat.png")
    if path == "/big":
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(64):
            await response.write(b"\0" * 1024)
        await response.write_eof()
        return response
    if path == "/slow":
        await asyncio.sleep(1)
    raise web.HTTPNotFound()


def fetched(run: Callable[[str], Awaitable[list[DecodedImage]]]) -> list[DecodedImage]:
    async def main() -> list[DecodedImage]:
        async with serving(routes) as url:
            return await run(url)
    return asyncio.run(main())


def fetch_all(paths: list[str], limits: ImageLimits) -> list[DecodedImage]:
    async def run(base: str) -> list[DecodedImage]:
        parts = tuple(ContentPart("image", image_url=base + path, where=f"images.{k}")
                      for k, path in enumerate(paths))
        return await load_images([MessageInput("user", parts)], limits, True)
    return fetched(run)


ALLOWED = ImageLimits(allowed_media_domains=("127.0.0.1",), fetch_timeout=2.0)


def test_an_allowed_host_is_fetched_and_same_host_redirects_followed() -> None:
    images = fetch_all(["/cat.png", "/moved"], ALLOWED)
    assert [image.where for image in images] == ["images.0", "images.1"]
    assert images[0].content_hash == images[1].content_hash == decoded(PNG).content_hash


@pytest.mark.parametrize(("path", "limits", "says"), [
    ("/missing", ALLOWED, "fetching the image from 127.0.0.1 failed: HTTP 404 Not Found"),
    ("/away", ALLOWED, "redirects to 'http://localhost:"),
    ("/big", ImageLimits(allowed_media_domains=("127.0.0.1",), max_bytes=10_000),
     "over 10,000 bytes"),
    ("/slow", ImageLimits(allowed_media_domains=("127.0.0.1",), fetch_timeout=0.3),
     "timed out after 0.3 s (--image-fetch-timeout)"),
])
def test_failed_fetches_are_a_400_naming_the_part(path: str, limits: ImageLimits,
                                                  says: str) -> None:
    """The first image is fetched; the second fails, and is the one named."""
    error = refusal(lambda: fetch_all(["/cat.png", path], limits))
    assert error.param == "images.1" and says in error.message, error


@pytest.mark.parametrize(("limits", "says"), [
    (ImageLimits(allowed_media_domains=("images.example.com",)),
     "the image URL's host '127.0.0.1' is not allowed; allowed: images.example.com "
     "(--allowed-media-domains)"),
    (LIMITS, NOT_ENABLED),
])
def test_hosts_not_allowed_are_never_reached(limits: ImageLimits, says: str) -> None:
    error = refusal(lambda: fetch_all(["/cat.png"], limits))
    assert error.param == "images.0" and says in error.message, error

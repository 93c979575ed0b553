"""A chat request's images, decoded once for every wire format: each image part of the neutral
input (`chat_input.py`) read from its data URL or fetched (`image_sources.py`), checked against
the server's limits (`ImageLimits`) and decoded with Pillow, off the event loop.

The checks run cheapest first, so a request is refused before anything costly: the count
(vLLM's text, which clients string-match to strip images and retry), then per image its bytes,
its pixel count as its header states it (a 20,000 x 20,000 PNG is refused without decoding a
row), then the decode. Every failure is a 400 naming the part (`bad_request`), never a 500 and
never an image silently dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from PIL import Image, ImageOps, UnidentifiedImageError

from nanoserve.entrypoints.serving.chat_input import ChatInput, MessageInput, image_parts
from nanoserve.entrypoints.serving.errors import APIError, bad_request
from nanoserve.entrypoints.serving.image_sources import data_url_bytes, fetch_image, url_kind
from nanoserve.server_config import ImageLimits, RequestLimits

HASH_BYTES = 16


@dataclass(frozen=True)
class DecodedImage:
    """One image of a request, decoded and loaded."""

    # EXIF orientation applied, an animation's first frame; its mode as decoded (RGBA, P, L,
    # ...): the model's processor converts to RGB as transformers does
    image: Image.Image
    # blake2b over the mode, the size and the decoded pixels (and a palette's colours), not
    # the encoded bytes: a re-encoded equal image hashes equal, as vLLM's MultiModalHasher
    content_hash: bytes
    where: str  # the part's field path in the request's own vocabulary: "messages.1.content.0"


class ImageContext(Protocol):
    """What of the server's context images read (a `ServerContext`; named by its fields, as
    the context's own modules import this one)."""

    @property
    def limits(self) -> RequestLimits: ...

    @property
    def accepts_images(self) -> bool: ...


async def collect_images(ctx: ImageContext, chat: ChatInput) -> list[DecodedImage]:
    """Every image part of every message, in order, decoded (see the module)."""
    return await load_images(chat.messages, ctx.limits.images, ctx.accepts_images)


async def load_images(messages: Sequence[MessageInput], limits: ImageLimits,
                      accepts_images: bool) -> list[DecodedImage]:
    """`collect_images` on the parts a context reads: the limits, and whether the model takes
    images at all (a text-only model takes none)."""
    parts = list(image_parts(messages))
    limit = limits.max_images if accepts_images else 0
    if len(parts) > limit:
        raise bad_request(too_many_images(limit, accepts_images), parts[limit][0])
    images = []
    for where, part in parts:  # in order: the first bad part is the one named
        if url_kind(part.image_url, where) == "data":
            images.append(await asyncio.to_thread(_decode_data_url, part.image_url or "",
                                                  where, limits))
        else:
            data = await fetch_image(part.image_url or "", where, limits)
            images.append(await asyncio.to_thread(decode_image, data, where,
                                                  limits.max_pixels))
    return images


def too_many_images(limit: int, accepts_images: bool) -> str:
    """vLLM's words, exactly: clients string-match them to strip the images and retry."""
    text = f"At most {limit} image(s) may be provided in one prompt."
    return text + " Set --limit-mm-per-prompt to increase this limit." if accepts_images \
        else text


def _decode_data_url(url: str, where: str, limits: ImageLimits) -> DecodedImage:
    return decode_image(data_url_bytes(url, where, limits.max_bytes), where, limits.max_pixels)


def decode_image(data: bytes, where: str, max_pixels: int) -> DecodedImage:
    """`data` decoded (see `DecodedImage`), its size checked from the header first."""
    try:
        opened = Image.open(io.BytesIO(data))  # reads the header: the size, not the pixels
    except Image.DecompressionBombError as e:  # past Pillow's guard (2 x MAX_IMAGE_PIXELS)
        raise bad_request(f"{where}: the image has over {2 * (Image.MAX_IMAGE_PIXELS or 0):,} "
                          f"pixels ({e}); at most {max_pixels:,} pixels are allowed "
                          "(--max-image-pixels)", where) from None
    except Exception as e:  # any type: see _undecodable
        raise _undecodable(e, where) from None
    with opened:
        width, height = opened.size
        if width * height > max_pixels:
            raise bad_request(f"{where}: the image is {width}x{height} "
                              f"({width * height:,} pixels); at most {max_pixels:,} pixels "
                              "are allowed (--max-image-pixels)", where)
        try:
            opened.load()  # the first frame of an animation
            image = ImageOps.exif_transpose(opened)  # a loaded copy, upright
        except Exception as e:  # any type: see _undecodable
            raise _undecodable(e, where) from None
    return DecodedImage(image, image_hash(image), where)


def _undecodable(error: Exception, where: str) -> APIError:
    """Pillow's format plugins fail on broken or hostile bytes with OSError,
    UnidentifiedImageError, SyntaxError, ValueError, EOFError, struct.error and more: whatever
    the type, undecodable bytes are the client's 400, not the server's 500."""
    if isinstance(error, UnidentifiedImageError):  # its text shows an object's address
        reason = "not an image format this server reads (PNG, JPEG, WebP, GIF, BMP, TIFF, ...)"
    else:
        reason = str(error) or type(error).__name__
    return bad_request(f"{where} could not be decoded as an image: {reason}", where)


def image_hash(image: Image.Image) -> bytes:
    """The content hash of a decoded image (see `DecodedImage`): the same pixels in the same
    mode hash equal whatever format carried them; a palette image's colours count too, so two
    palettes over the same indices differ."""
    digest = hashlib.blake2b(digest_size=HASH_BYTES)
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    palette = image.getpalette()
    if palette is not None:
        digest.update(bytes(palette))
    transparency = image.info.get("transparency")
    if transparency is not None:
        digest.update(repr(transparency).encode())
    return digest.digest()

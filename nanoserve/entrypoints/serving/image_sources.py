"""Where an image part's bytes come from: the base64 of a `data:` URL, or an http(s) URL on a
host the operator allowed (`--allowed-media-domains`, vLLM's flag; none by default, as Ollama
fetches none). Every failure is a 400 naming the part, never a 500 (vLLM answered 500 for a
failed fetch: its issues #47163, #40856).

A fetch is bounded three ways: the whole of it by `--image-fetch-timeout`, its body by
`--max-image-bytes` while it streams in (a lying or absent Content-Length changes nothing),
and its redirects to the same host (a redirect elsewhere could reach a host nobody allowed).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from urllib.parse import urlsplit

import httpx

from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.server_config import ImageLimits

MAX_REDIRECTS = 3
IMAGE_MEDIA_TYPES = "image/png, image/jpeg, image/webp or image/gif"
NOT_ENABLED = ("image URLs are not enabled on this server; send the image as a data: URL "
               "(base64), or start the server with --allowed-media-domains HOST")
_SHOWN = 80  # characters of a URL quoted back (a data URL can be megabytes)
_WHITESPACE = re.compile(rb"\s+")


def url_kind(url: str | None, where: str) -> str:
    """"data" or "http" for a URL this server reads; a 400 for none or another scheme."""
    if not url:
        raise bad_request(f"{where} has no image URL; send it as a data: URL (base64) or an "
                          "http(s) URL", where)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return "data"
    if scheme in ("http", "https"):
        return "http"
    raise bad_request(f"{where}: the URL must be either a HTTP or data URL (http:, https: or "
                      f"data:), got {shown(url)}", where)


def data_url_bytes(url: str, where: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:` URL whose media type is an image's or absent (Ollama's
    `data:;base64,`); line breaks and missing padding are forgiven, as encoders differ."""
    header, has_comma, payload = url[len("data:"):].partition(",")
    if not has_comma:
        raise bad_request(f"{where}: a data URL needs a comma before its data, as in "
                          "data:image/png;base64,...", where)
    media_type, *params = (param.strip().lower() for param in header.split(";"))
    if media_type and not media_type.startswith("image/"):
        raise bad_request(f"{where}: the data URL's media type {media_type!r} is not an "
                          f"image's; send {IMAGE_MEDIA_TYPES}", where)
    if "base64" not in params:
        raise bad_request(f"{where}: a data URL must carry base64, as in "
                          "data:image/png;base64,...", where)
    text = _WHITESPACE.sub(b"", payload.encode("ascii", "replace"))
    check_size(len(text) * 3 // 4 - 2, max_bytes, where)  # before decoding any of it
    text += b"=" * (-len(text) % 4)
    altchars = b"-_" if b"-" in text or b"_" in text else None  # the URL-safe alphabet
    try:
        data = base64.b64decode(text, altchars=altchars, validate=True)
    except binascii.Error as e:
        raise bad_request(f"{where}: the data URL's base64 is invalid: {e}", where) from None
    check_size(len(data), max_bytes, where)
    return data


async def fetch_image(url: str, where: str, limits: ImageLimits) -> bytes:
    """The body of an http(s) image URL on an allowed host (see the module)."""
    host = _allowed_host(url, where, limits.allowed_media_domains)
    try:
        async with asyncio.timeout(limits.fetch_timeout), \
                httpx.AsyncClient(follow_redirects=False,
                                  timeout=limits.fetch_timeout) as client:
            for _ in range(MAX_REDIRECTS + 1):
                async with client.stream("GET", url) as response:
                    if not response.is_redirect:
                        return await _body(response, host, where, limits.max_bytes)
                    url = str(response.url.join(response.headers["location"]))
                _same_host(url, host, where)
    except TimeoutError:
        raise bad_request(f"{where}: fetching the image from {host} timed out after "
                          f"{limits.fetch_timeout:g} s (--image-fetch-timeout)", where) from None
    except httpx.HTTPError as e:
        raise bad_request(f"{where}: fetching the image from {host} failed: "
                          f"{type(e).__name__}: {e}", where) from None
    raise bad_request(f"{where}: fetching the image from {host} failed: more than "
                      f"{MAX_REDIRECTS} redirects", where)


async def _body(response: httpx.Response, host: str, where: str, max_bytes: int) -> bytes:
    if response.status_code != 200:
        raise bad_request(f"{where}: fetching the image from {host} failed: HTTP "
                          f"{response.status_code} {response.reason_phrase}".rstrip(), where)
    length = response.headers.get("content-length")
    if length is not None and length.isdigit():
        check_size(int(length), max_bytes, where)
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        check_size(size, max_bytes, where)
        chunks.append(chunk)
    return b"".join(chunks)


def _allowed_host(url: str, where: str, domains: tuple[str, ...]) -> str:
    if not domains:
        raise bad_request(f"{where}: {NOT_ENABLED}", where)
    host = (urlsplit(url).hostname or "").lower()
    if host not in (domain.lower() for domain in domains):
        raise bad_request(f"{where}: the image URL's host {host!r} is not allowed; allowed: "
                          f"{', '.join(domains)} (--allowed-media-domains)", where)
    return host


def _same_host(url: str, host: str, where: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or (parts.hostname or "").lower() != host:
        raise bad_request(f"{where}: the image URL on {host} redirects to {shown(url)}, "
                          "another host, which is not followed", where)


def check_size(num_bytes: int, max_bytes: int, where: str) -> None:
    if num_bytes > max_bytes:
        raise bad_request(f"{where}: the image is over {max_bytes:,} bytes "
                          "(--max-image-bytes)", where)


def shown(url: str) -> str:
    return repr(url if len(url) <= _SHOWN else url[:_SHOWN] + "...")


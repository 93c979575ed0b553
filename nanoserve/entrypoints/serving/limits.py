"""Limits that protect the server from one request (`RequestLimits`, set by `nanoserve serve`
flags): the body's size, `n`, and the number and length of stop strings.

Each is a 4xx in OpenAI's error shape naming the field, the value and the limit, given before
any work is done. Context length and `max_tokens` are bounded in token_limits.py, logprobs in
request_params.py (they depend on the prompt and the engine); the per-request deadline lives
in AsyncEngine.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

from nanoserve.entrypoints.serving.errors import bad_request, error_body
from nanoserve.server_config import RequestLimits


def body_too_large(limit: int, size: int | None) -> str:
    got = "" if size is None else f", got {size} bytes"
    return (f"the request body must be at most {limit} bytes (--max-request-body-bytes){got}")


class BodyLimitMiddleware:
    """HTTP 413 for bodies over `limit` bytes, as pure ASGI (it keeps disconnect events).

    A declared Content-Length over the limit is refused before any of the body is read; a
    chunked body is counted as it arrives and refused once it passes the limit (raised as
    Starlette's HTTPException, which FastAPI passes on to the error handlers untouched).
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await _send_json(send, 413, error_body(413, body_too_large(self.limit, declared)))
            return
        received = 0

        async def counting_receive() -> dict[str, Any]:
            nonlocal received
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, body_too_large(self.limit, None))
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 has already refused a malformed length
    return None


async def _send_json(send: Any, status: int, body: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def check_n(limits: RequestLimits, n: int) -> None:
    """n past --max-n: each sample is a sequence in the engine (n=1000000 stalled everyone)."""
    if n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n} (--max-n), got {n}", "n")


def check_stops(limits: RequestLimits, stops: list[str] | None) -> None:
    """Stop strings are checked on every new token of every sample, so count and length are
    bounded."""
    _check_texts(stops, "stop", ("strings", "stop string"), limits.max_stop_strings,
                 "--max-stop-strings", limits.max_stop_string_length)


def check_bad_words(limits: RequestLimits, words: list[str] | None) -> None:
    """Bad words are matched against the output on every step of every sample, so count and
    length are bounded (the length as a stop string's)."""
    _check_texts(words, "bad_words", ("words", "bad word"), limits.max_bad_words,
                 "--max-bad-words", limits.max_stop_string_length)


def _check_texts(texts: list[str] | None, field: str, nouns: tuple[str, str], max_count: int,
                 count_flag: str, max_length: int) -> None:
    """At most `max_count` texts (else a 400 naming `count_flag`), each of at most `max_length`
    characters (--max-stop-string-length); `nouns`: the texts counted, and one of them."""
    if not texts:
        return
    if len(texts) > max_count:
        raise bad_request(f"{field} must be at most {max_count} {nouns[0]} ({count_flag}), "
                          f"got {len(texts)}", field)
    for text in texts:
        if len(text) > max_length:
            raise bad_request(f"each {nouns[1]} must be at most {max_length} characters "
                              f"(--max-stop-string-length), got one of {len(text)}", field)

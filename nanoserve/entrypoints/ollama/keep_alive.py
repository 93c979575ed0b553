"""Ollama's `keep_alive`: how long a model stays loaded after a request, as seconds.

Ollama takes a Go duration string ("5m", "1h30m", "10s", "1.5h", "300ms"), or a number of
seconds; a negative value keeps the model loaded forever, 0 unloads it after the request, and
an absent one means Ollama's default, five minutes. A bare number in a string ("300") is read
as seconds too (Ollama's `OLLAMA_KEEP_ALIVE` takes it that way).

In a single-model server the model is loaded when the server starts and stays loaded until it
stops, so `keep_alive` changes nothing there: it is parsed so that a bad value is a 400 naming
the field, as Ollama answers, and so that an empty request with `keep_alive: 0` can answer
"unload". A server holding several models reads the same seconds to decide what to unload.
"""

from __future__ import annotations

import math
import re

from nanoserve.entrypoints.serving.errors import bad_request

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: five minutes
# Go's time.ParseDuration units, in seconds
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)")
_FORM = ('a duration such as "5m", "1h30m" or "10s", or a number of seconds '
         "(negative: forever, 0: unload now)")


def parse_keep_alive(value: object, field: str = "keep_alive",
                     default: float = DEFAULT_KEEP_ALIVE_S) -> float | None:
    """`value` as seconds: None (absent) gives `default`, a negative value None (forever).
    Anything else is a 400 naming `field`, the value and the forms allowed."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _bad(value, field)
    if isinstance(value, str):
        seconds = _duration_seconds(value.strip())
        if seconds is None:
            raise _bad(value, field)
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise _bad(value, field)
    return None if seconds < 0 else seconds


def _duration_seconds(text: str) -> float | None:
    """A Go duration or a bare number, in seconds; None when it is neither."""
    if _NUMBER.fullmatch(text):
        return float(text)
    sign = -1.0 if text.startswith("-") else 1.0
    body = text[1:] if text[:1] in "+-" else text
    if not body:
        return None
    total, position = 0.0, 0
    for match in _PART.finditer(body):
        if match.start() != position:
            return None
        total += float(match[1]) * _UNITS[match[2]]
        position = match.end()
    return sign * total if position == len(body) else None


def _bad(value: object, field: str) -> Exception:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:80] + "..."
    return bad_request(f"{field} must be {_FORM}, got {shown}", field)

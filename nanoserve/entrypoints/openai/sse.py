"""Server-sent events framing: one `data: <json>` event per chunk, errors after the stream has
started as one error event, and the closing `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from nanoserve.entrypoints.serving.engine_errors import SERVING_ERRORS, api_error_of
from nanoserve.entrypoints.serving.errors import sse_error


def sse_event(body: dict[str, Any], ensure_ascii: bool = False) -> str:
    """One event: the body as JSON (non-ASCII text as it is, unless `ensure_ascii`)."""
    return f"data: {json.dumps(body, ensure_ascii=ensure_ascii)}\n\n"


async def sse_with_errors(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """A stream's events, then `data: [DONE]`. An error after the stream has started (the 200
    is already sent) becomes one `data: {"error": ...}` event, as OpenAI's clients expect."""
    try:
        async for event in events:
            yield event
    except SERVING_ERRORS as e:
        yield sse_error(api_error_of(e))
    finally:
        await events.aclose()  # (a client that went away: its requests are aborted now)
    yield "data: [DONE]\n\n"

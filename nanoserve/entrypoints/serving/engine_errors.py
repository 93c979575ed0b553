"""The one mapping from what can go wrong while a request is served to the API's status.

Every wire format asks it: the app's handlers before the 200 (serving/error_handlers.py) and
each stream after it (OpenAI's SSE, Anthropic's and Responses' events, Ollama's lines), so an
engine that stopped is 503 and a timed-out request 408 on every API, in each API's shape.
"""

from __future__ import annotations

from nanoserve.entrypoints.serving.async_engine import EngineDeadError, RequestTimeoutError
from nanoserve.entrypoints.serving.errors import APIError, bad_request

# what a request's serving raises that is an answer to the client, not a bug (500)
SERVING_ERRORS: tuple[type[Exception], ...] = (
    APIError, EngineDeadError, RequestTimeoutError, ValueError)


def api_error_of(error: Exception) -> APIError:
    """`error` (one of SERVING_ERRORS) as the APIError the client gets."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine stopped: {error}")
    if isinstance(error, RequestTimeoutError):
        # 408, as LiteLLM answers a timed-out call; the OpenAI SDK retries it like a 5xx
        return APIError(408, str(error))
    return bad_request(str(error))

"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}}, with the right status.

A client's mistake is a 4xx that names the field, the value and what is allowed; never a 5xx
(the OpenAI SDK retries 5xx twice, tripling the bad load) and never FastAPI's default 422.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          413: "PayloadTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error the API returns as OpenAI error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_value_error(error: ValueError) -> APIError:
    """SamplingParams' messages start with the field's name ("top_p must be in (0, 1], ...")."""
    message = str(error)
    match = re.match(r"(?:extra_args\['([\w.]+)'\]|([a-z_]+)) must ", message)
    param = None if match is None else (f"extra_args.{match[1]}" if match[1] else match[2])
    return bad_request(message, param)


def sse_error(error: APIError) -> str:
    """An error after the stream has started: one `data: {"error": ...}` event."""
    return f"data: {json.dumps(error.body())}\n\n"


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Pydantic's complaints as a 400 naming the field (not a 422)."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    first = errors[0] if errors else {}
    param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    message = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}: " + \
        "; ".join(parts)
    return JSONResponse(error_body(400, message, param), status_code=400)

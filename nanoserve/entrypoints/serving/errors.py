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
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError", 408: "TimeoutError", 413: "PayloadTooLargeError",
          429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_MAX_SHOWN_INPUT = 80  # characters of an offending value quoted back in a validation error


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
    """Pydantic's complaints as a 400 naming the field and the value sent (not a 422)."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        detail = errors[0].get("ctx", {}).get("error", "invalid JSON")
        return JSONResponse(error_body(400, f"the request body is not valid JSON: {detail} "
                                            f"(at character {errors[0]['loc'][-1]})"),
                            status_code=400)
    parts = [f"{_loc(err) or 'body'}: {err.get('msg', 'invalid')}{_shown_input(err)}"
             for err in errors]
    param = _loc(errors[0]) if errors else None
    message = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}: " + \
        "; ".join(parts)
    return JSONResponse(error_body(400, message, param or None), status_code=400)


def _loc(err: Any) -> str:
    return ".".join(str(x) for x in err.get("loc", ()) if x != "body")


def _shown_input(err: Any) -> str:
    """`, got 'wizard'`: the value that failed, cut short (bodies can be megabytes)."""
    if "input" not in err or err.get("type") == "missing":
        return ""
    shown = repr(err["input"])
    if len(shown) > _MAX_SHOWN_INPUT:
        shown = shown[:_MAX_SHOWN_INPUT] + "..."
    return f", got {shown}"


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (no such route, wrong method, a body it cannot parse) in OpenAI's
    shape instead of `{"detail": ...}`."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404 and exc.detail == "Not Found":  # Starlette's own: no route
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405 and exc.detail == "Method Not Allowed":
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed on {request.url.path}; " \
                  f"allowed: {allowed}"
    elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        message = "the request body could not be parsed as JSON (malformed, or nested too deeply)"
    else:
        message = str(exc.detail)
    return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                        headers=exc.headers)

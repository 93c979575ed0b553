"""Anthropic's error shape on the Messages paths: `{"type": "error", "error": {"type", "message"}}`
with the status the error already has, for every error those paths can give.

The server's errors are made in OpenAI's shape, by the exception handlers (`serving/errors.py`),
the API-key check (`serving/auth.py`) and the body limit (`serving/limits.py`). Rather than teach
each of them a second shape, one ASGI middleware, outside all of them, rewrites an error answer
on a path under `/v1/messages` into Anthropic's (`serving/error_shape.py`): the status picks
the type, as Anthropic's API does, and the OpenAI `param` is named in the message (in this
API's words: `tools.0.input_schema`, not `tools.0.function.parameters`), since Anthropic's
shape has no field for it. An exception no handler knows (a bug) is answered 500, `api_error`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from nanoserve.entrypoints.serving.error_shape import ErrorShape

MESSAGES_PATH = "/v1/messages"

# Anthropic's types per status (docs.anthropic.com/en/api/errors); 503 is nanoserve's
# "not now" (engine stopped, shutting down), which Anthropic calls overloaded (its 529)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
          429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
# the neutral chat machinery names fields as chat completions does; these are this API's names
_RENAMES = [(re.compile(r"^tools\.(\d+)\.function\.parameters"), r"tools.\1.input_schema"),
            (re.compile(r"^tools\.(\d+)\.function\.name"), r"tools.\1.name"),
            (re.compile(r"^response_format\.json_schema(\.schema)?"), r"output_config.format\1"),
            (re.compile(r"^stop$"), "stop_sequences")]


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The error body Anthropic's API answers (and its SDKs parse)."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def renamed_field(param: str) -> str:
    """A chat-completions field name as this API calls it."""
    for pattern, replacement in _RENAMES:
        if pattern.match(param):
            return pattern.sub(replacement, param, count=1)
    return param


def reshape_error(body: bytes, status: int) -> bytes:
    """An OpenAI error body as Anthropic's; a body in no known shape keeps its text, and one in
    Anthropic's already (a model's server's, relayed by the router of --models-dir) is kept."""
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict) and parsed.get("type") == "error":
            return body
        error = parsed["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = body.decode("utf-8", "replace") or f"HTTP {status}", None
    if isinstance(param, str) and param:
        named = renamed_field(param)
        if message.startswith(param):
            message = named + message[len(param):]
        elif named not in message:
            message = f"{named}: {message}"
    return json.dumps(anthropic_error(status, message)).encode()


class AnthropicErrorShape(ErrorShape):
    """ASGI middleware: on the Messages paths, every error answer in Anthropic's shape (see
    the module). Other paths pass straight through; so does any answer below status 400."""

    def __init__(self, app: Any) -> None:
        super().__init__(app, is_messages_path, reshape_error,
                         lambda message: json.dumps(anthropic_error(500, message)).encode())

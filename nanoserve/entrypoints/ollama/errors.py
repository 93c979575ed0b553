"""Ollama's error shape on its paths (`/api/...`): `{"error": "<message>"}` with the status the
error already has, for every error those paths can give (the 401s and 413s too), by the
middleware in `serving/error_shape.py`.

Ollama's shape has no field for the request field at fault, so OpenAI's `param` is named in
the message, in this API's words: the neutral chat machinery names fields as chat completions
does (`temperature`, `max_tokens`, `response_format.json_schema.schema`), which are
`options.temperature`, `options.num_predict` and `format` here. The Ollama clients raise the
message with the status (`ollama.ResponseError`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from nanoserve.entrypoints.serving.error_shape import ErrorShape
from nanoserve.entrypoints.serving.llama_sampler_fields import LLAMA_SAMPLER_FIELDS

API_PREFIX = "/api/"
_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
            "frequency_penalty", *LLAMA_SAMPLER_FIELDS)
_RENAMES = [(re.compile(rf"^{name}\b"), f"options.{name}") for name in _OPTIONS] + [
    (re.compile(r"^repetition_penalty\b"), "options.repeat_penalty"),
    (re.compile(r"^max_tokens\b"), "options.num_predict"),
    (re.compile(r"^response_format(\.json_schema(\.schema)?)?"), "format"),
    (re.compile(r"^tool_choice\b"), "tools")]


def is_ollama_path(path: str) -> bool:
    return path.startswith(API_PREFIX)


def renamed_field(param: str) -> str:
    """A chat-completions field name as this API calls it."""
    for pattern, replacement in _RENAMES:
        if pattern.match(param):
            return pattern.sub(replacement, param, count=1)
    return param


def ollama_message(message: str, param: str | None) -> str:
    """The message with the field at fault named in this API's words."""
    if not param:
        return message
    named = renamed_field(param)
    if message.startswith(param):
        return named + message[len(param):]
    return message if named in message else f"{named}: {message}"


def ollama_error(message: str) -> dict[str, Any]:
    """The error body Ollama's API answers (and its clients parse)."""
    return {"error": message}


def reshape_error(body: bytes, status: int) -> bytes:
    """An OpenAI error body as Ollama's; a body in no known shape keeps its text, and one in
    Ollama's already (a model's server's, relayed by the router of --models-dir) is kept."""
    try:
        error = json.loads(body)["error"]
        if isinstance(error, str):
            return body
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = body.decode("utf-8", "replace") or f"HTTP {status}", None
    return json.dumps(ollama_error(ollama_message(
        message, param if isinstance(param, str) else None))).encode()


class OllamaErrorShape(ErrorShape):
    """ASGI middleware: every error answer under `/api/` in Ollama's shape (see the module)."""

    def __init__(self, app: Any) -> None:
        super().__init__(app, is_ollama_path, reshape_error,
                         lambda message: json.dumps(ollama_error(message)).encode())

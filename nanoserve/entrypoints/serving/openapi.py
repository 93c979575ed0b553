"""/openapi.json as the server really answers: each route's response models and error statuses.

FastAPI documents a 422 `{"detail": [...]}` for every route with a body; this server answers
validation errors with 400 and OpenAI's error object (errors.py), so those entries are replaced
by the statuses each route can give, all with `ErrorResponse`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from nanoserve.entrypoints.serving.api_models import ErrorResponse

_ERROR_REASONS = {
    400: "a field is invalid or out of range; `param` names it",
    401: "no API key or a wrong one (with --api-key)",
    404: "`model` names another model",
    408: "the request ran past --request-timeout and was stopped",
    413: "the body is larger than --max-request-body-bytes",
    429: "the server has --max-in-flight sequences (requests times n) in flight; retry later",
    503: "the engine is not running, or the server is shutting down",
}
# what every generating route can answer besides 200
GENERATE_ERRORS = (400, 401, 404, 408, 413, 429, 503)
# an event stream: `data: <chunk JSON>` events, then `data: [DONE]`; an error after the 200
# is one `data: {"error": ...}` event before `[DONE]`. Before OpenAPI 3.2's `itemSchema`, a
# stream's `schema` describes each event as clients parse it (its `data` text, and the
# `event` name the Messages and Responses APIs send), as schemathesis reads it.
EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                   "id": {"type": "string"}, "retry": {"type": "integer"}}}}}


def responses(model: type | None, *errors: int, streams: bool = False,
              media_type: str = "application/json") -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: 200 with `model` (and an event stream where `streams`),
    then each error status with OpenAI's error object."""
    ok: dict[str, Any] = {"description": "success"}
    if model is not None:
        ok["model"] = model
    elif media_type != "application/json":
        ok["content"] = {media_type: {"schema": {"type": "string"}}}
    if streams:
        ok["content"] = dict(EVENT_STREAM)
        ok["description"] = "the whole response, or with `stream: true` an event stream"
    out: dict[int | str, dict[str, Any]] = {200: ok}
    for status in errors:
        out[status] = {"model": ErrorResponse, "description": _ERROR_REASONS[status]}
    return out


def install_openapi(app: FastAPI) -> None:
    """Serve the corrected document (built once, on the first request for it)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

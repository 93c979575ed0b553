"""Anthropic's Messages routes on the server's app. The `anthropic-version` and
`anthropic-beta` headers and the `?beta=true` query (the SDK's beta client, Claude Code) are
accepted and change nothing; errors take Anthropic's shape (`errors.py`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from nanoserve.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from nanoserve.entrypoints.anthropic.response_models import (
    AnthropicErrorResponse,
    AnthropicMessageResponse,
    CountTokensResponse,
)
from nanoserve.entrypoints.anthropic.serving_messages import count_tokens, create_message
from nanoserve.entrypoints.serving.openapi import EVENT_STREAM
from nanoserve.entrypoints.serving.server_context import ServerContext

# the statuses each route can answer besides 200, and why (the type is Anthropic's)
_REASONS = {
    400: "invalid_request_error: a field is invalid; the message names it",
    401: "authentication_error: no API key or a wrong one (with --api-key; x-api-key or "
         "Authorization: Bearer)",
    404: "not_found_error: `model` names another model",
    408: "timeout_error: the request ran past --request-timeout",
    413: "request_too_large: the body is larger than --max-request-body-bytes",
    429: "rate_limit_error: the server is at --max-in-flight; retry later",
    503: "overloaded_error: the engine is not running, or the server is shutting down",
}


def _responses(model: type, *errors: int, streams: bool = False
               ) -> dict[int | str, dict[str, Any]]:
    ok: dict[str, Any] = {"description": "success", "model": model}
    if streams:
        ok["description"] = "the message, or with `stream: true` Anthropic's named events"
        ok["content"] = dict(EVENT_STREAM)
    out: dict[int | str, dict[str, Any]] = {200: ok}
    for status in errors:
        out[status] = {"model": AnthropicErrorResponse, "description": _REASONS[status]}
    return out


def add_messages_routes(app: FastAPI, ctx: ServerContext, *,
                        strip_billing_header: bool = True) -> None:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens`. `strip_billing_header`:
    take Claude Code's billing line off the system prompt (`billing_header.py`)."""

    @app.post("/v1/messages", response_model=None,
              responses=_responses(AnthropicMessageResponse, *_REASONS, streams=True))
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        return await create_message(ctx, req, raw, strip_billing=strip_billing_header)

    @app.post("/v1/messages/count_tokens", response_model=None,
              responses=_responses(CountTokensResponse, 400, 401, 404, 413))
    async def messages_count_tokens(req: CountTokensRequest) -> dict[str, int]:
        return await count_tokens(ctx, req, strip_billing=strip_billing_header)

"""Response bodies of the Messages routes, as pydantic models for the OpenAPI document only
(the handlers build dicts: `message_content.py`, `messages_stream.py`, `errors.py`), so that
/openapi.json is accurate and the schemathesis test can hold the answers to it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicMessageUsage(ResponseModel):
    input_tokens: int  # the prompt tokens computed for this request
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int  # the prompt tokens the prefix cache served


class AnthropicMessageResponse(ResponseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    # `text`, `thinking` (with a reasoning parser) and `tool_use` (`id`, `name`, `input`)
    content: list[dict[str, Any]]
    stop_reason: StopReason
    stop_sequence: str | None
    usage: AnthropicMessageUsage


class CountTokensResponse(ResponseModel):
    input_tokens: int


class AnthropicErrorInfo(ResponseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    message: str


class AnthropicErrorResponse(ResponseModel):
    """Every 4xx and 5xx on the Messages routes: Anthropic's error object."""

    type: Literal["error"]
    error: AnthropicErrorInfo

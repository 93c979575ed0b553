"""The base models every wire format's request and response bodies build on, and the error
object every API answers in OpenAI's shape (its own shape is made from it at the edge).

Requests: `OpenAIModel` accepts unknown fields (a newer client's must not break an older
server); `documented` puts a field's range in /openapi.json while its check stays where its
message is written. Responses: `ResponseModel` describes the JSON the handlers build, for the
OpenAPI document and the schema tests only.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def documented(default: Any, **schema: Any) -> Any:
    """A field whose /openapi.json entry gets `schema` (bounds, an enum, a shape) while the
    check stays where its error message is written (SamplingParams, the serving modules)."""
    return Field(default, json_schema_extra=schema)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None  # the request field at fault, when there is one
    code: int  # the HTTP status (vLLM's choice; OpenAI sends a string or null)


class ErrorResponse(ResponseModel):
    """Every 4xx and 5xx: OpenAI's error object."""

    error: ErrorInfo

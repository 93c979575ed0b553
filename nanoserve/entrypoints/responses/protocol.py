"""Request bodies of OpenAI's Responses API (`POST /v1/responses`), and the response object as
/openapi.json describes it.

The body is checked for shape here; `input` and `tools` are kept as raw JSON and each item is
checked by `request.py` against the item models below, so an error names the item as the client
wrote it (`input.3.call_id`, `tools.1.name`) rather than pydantic's union branches. Unknown
fields are accepted and ignored, as on the other OpenAI routes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from nanoserve.entrypoints.serving.api_models import OpenAIModel, ResponseModel, documented

_TEXT_PART = {"type": "object", "required": ["type"],
              "properties": {"type": {"type": "string"}, "text": {"type": "string"},
                             "image_url": {"type": "string"}}}
_CONTENT_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "string"},
                                             {"type": "array", "items": _TEXT_PART}]}
_INPUT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "object", "properties": {"type": {
        "enum": ["message", "function_call", "function_call_output", "reasoning"]}}}}]}


class InputPart(OpenAIModel):
    """A part of a message's content (`input_text`, `output_text`, `refusal`, `input_image`;
    others are refused by `request.py`, naming the part). An image's `image_url` is a data: or
    http(s) URL (checked where it is read: serving/images.py); `file_id` is refused (no files
    are stored here)."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | dict[str, Any] | None = None  # a URL; {"url": ...} is accepted too
    file_id: str | None = None
    detail: str | None = None  # accepted: the model's processor decides


class MessageItem(OpenAIModel):
    """A turn: `{"role", "content"}`, with or without `"type": "message"`."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Any = Field(json_schema_extra=_CONTENT_SCHEMA)  # checked in request.py


class FunctionCallItem(OpenAIModel):
    """A call an earlier turn made (as this server returned it)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text


class FunctionCallOutputItem(OpenAIModel):
    """The result of call `call_id`: text, or text parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: Any = Field(json_schema_extra=_CONTENT_SCHEMA)  # checked in request.py


class ReasoningItem(OpenAIModel):
    """An earlier turn's reasoning (its summary or its text; encrypted content is ignored)."""

    type: Literal["reasoning"]
    summary: list[InputPart] = Field(default_factory=list)
    content: list[InputPart] | None = None


class TextOptions(OpenAIModel):
    """`text`: the output's format (`text`, `json_schema`, `json_object`); `verbosity` is
    accepted and ignored."""

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(OpenAIModel):
    """`POST /v1/responses`. Stateless: `previous_response_id`, `conversation` and
    `background` are refused with a 400 (`request.py`); `store`, `include`, `metadata`,
    `reasoning`, `prompt_cache_key` and the like are accepted."""

    model: str | None = None
    input: Any = Field(json_schema_extra=_INPUT_SCHEMA)  # checked in request.py
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # checked in request.py and tool_plan.py
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: int | None = documented(None, minimum=1)
    temperature: float | None = documented(None, minimum=0, maximum=2)  # OpenAI's range
    top_p: float | None = documented(None, exclusiveMinimum=0, maximum=1)
    stream: bool = False
    ignore_eos: bool = False  # vLLM's extra sampling field (benchmarks: fixed-length output)
    cache_salt: str | None = documented(None, minLength=1)  # the prefix cache's (vLLM's)
    priority: int = 0  # vLLM's (--scheduling-policy priority)
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    previous_response_id: str | None = None  # refused: the server keeps no responses
    conversation: Any = None  # refused, as previous_response_id
    background: bool | None = None  # refused when true: it needs a stored response


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens: served by the prefix cache
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseBody(ResponseModel):
    """`POST /v1/responses` without `stream` (with it: `text/event-stream` events, each named
    by its `type` and numbered by `sequence_number`, the last one holding this object)."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    incomplete_details: dict[str, str] | None
    error: dict[str, Any] | None
    output: list[dict[str, Any]]  # message, function_call and reasoning items
    output_text: str
    usage: ResponseUsage | None

"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extra ones).

Only shapes and types are checked here; value ranges are SamplingParams' job (its messages
name the field, the value and the range). The ranges are also *documented* here (`documented`)
so /openapi.json states them; tests/entrypoints/test_openapi_schema.py checks that the two agree.
Unknown fields are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from nanoserve.entrypoints.serving.api_models import OpenAIModel, documented
from nanoserve.entrypoints.serving.llama_sampler_fields import LlamaSamplerFields
from nanoserve.sampling_params import MAX_FLOAT32, MAX_INT64

# OpenAI's rule for function names (letters, digits, `_`, `-`; at most 64), plus `.`, which
# namespaced tool names use and vLLM accepts.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_TEXT = {"type": "string", "minLength": 1}
# documented shapes of union fields (their checks: serving_completion.py, SamplingParams)
_PROMPT_SCHEMA: dict[str, Any] = {"anyOf": [
    _TEXT, {"type": "array", "minItems": 1, "items": _TEXT}, _TOKEN_IDS,
    {"type": "array", "minItems": 1, "items": _TOKEN_IDS}]}
_STOP_SCHEMA = {"anyOf": [_TEXT, {"type": "array", "items": _TEXT}, {"type": "null"}]}


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(LlamaSamplerFields):
    """Fields shared by /v1/completions and /v1/chat/completions (llama-server's samplers
    among them, as its OpenAI routes take them)."""

    model: str | None = None
    n: int = documented(1, minimum=1)  # at most --max-n (limits.py)
    temperature: float | None = documented(None, minimum=0, maximum=MAX_FLOAT32)
    top_p: float | None = documented(None, exclusiveMinimum=0, maximum=1)
    seed: int | None = documented(None, minimum=-(2**63), maximum=2**64 - 1)
    stop: str | list[str] | None = documented(None, **_STOP_SCHEMA)  # at most --max-stop-strings
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = documented(None, minimum=-2, maximum=2)
    frequency_penalty: float | None = documented(None, minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = documented(None, minimum=-1, maximum=MAX_INT64)
    min_p: float | None = documented(None, minimum=0, maximum=1)
    repetition_penalty: float | None = documented(None, exclusiveMinimum=0, maximum=MAX_FLOAT32)
    min_tokens: int = documented(0, minimum=0, maximum=MAX_INT64)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = documented(None, minimum=0)  # at most --max-logprobs
    thinking_token_budget: int | None = documented(None, minimum=0, maximum=MAX_INT64)
    logprobs_mode: Literal["raw", "processed"] = "raw"
    extra_args: dict[str, Any] | None = None
    cache_salt: str | None = documented(None, minLength=1)  # the prefix cache's (vLLM's)
    # llama-server's: a stream sends `prompt_progress` chunks while the prompt is computed
    # (openai/progress.py); ignored unless streaming
    return_progress: bool = False
    # vLLM's: lower first under --scheduling-policy priority; non-zero otherwise is a 400
    priority: int = 0
    # structured outputs, every shape vLLM takes (read by structured_outputs.py, which names
    # the field in its errors): OpenAI's, vLLM's object, and vLLM's older top-level names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = documented(None, anyOf=[_TEXT, {"type": "null"}])
    guided_choice: list[str] | None = documented(
        None, anyOf=[{"type": "array", "minItems": 1, "items": _TEXT}, {"type": "null"}])
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # ignored: llguidance is the one backend


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra=_PROMPT_SCHEMA)
    max_tokens: int | None = documented(16, minimum=0)  # 0 only with echo
    logprobs: int | None = documented(None, minimum=0)  # at most --max-logprobs
    echo: bool = False
    suffix: str | None = None  # a fill-in-the-middle prompt (serving/infill_prompt.py)
    best_of: int | None = None


class ImageURL(OpenAIModel):
    url: str
    detail: str | None = None  # "auto", "low", "high": accepted; the model's processor decides


class ContentPartModel(OpenAIModel):
    """A content part: `{"type": "text", "text"}` or `{"type": "image_url", "image_url":
    {"url", "detail"}}` (vLLM also takes `image_url` as the URL itself); another type gets a
    400 naming the part, and an image's URL is checked where it is read (serving/images.py)."""

    type: str = documented(..., enum=["text", "image_url"])
    text: str | None = None
    image_url: ImageURL | str | None = None


class FunctionDefinition(OpenAIModel):
    name: str = documented(..., pattern=f"^{_FUNCTION_NAME.pattern}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not _FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"must be 1 to 64 letters, digits, '_', '-' or '.', got {name!r}")
        return name


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text


class MessageToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    # documented rules checked in chat_prompt.py: a tool message names the call it answers;
    # only an assistant's message carries tool calls
    model_config = ConfigDict(extra="allow", json_schema_extra={"allOf": [
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"],
                  "properties": {"tool_call_id": {"type": "string"}}}},
        {"if": {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
         "then": {"properties": {"role": {"const": "assistant"}}}}]})

    # OpenAI's roles ("developer" is its newer name for "system"; "function" its deprecated
    # "tool"); anything else is a 400 naming messages.<i>.role and these
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPartModel] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a `tool` message: the call it answers
    # an assistant's earlier reasoning, as vLLM reads it (either name), to the template
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = documented(None, minimum=1)
    max_completion_tokens: int | None = documented(None, minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = documented(None, minimum=0)  # at most --max-logprobs
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    # a thinking budget with a --reasoning-parser (reasoning_options.py); else accepted
    reasoning_effort: str | None = documented(None, anyOf=[
        {"type": "string", "enum": ["none", "minimal", "low", "medium", "high", "xhigh"]},
        {"type": "null"}])
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # checked in tool_plan.py, for errors that name the field
    parallel_tool_calls: bool = True


class TokenizeRequest(OpenAIModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]

"""Request bodies of the OpenAI-compatible API (OpenAI's fields plus vLLM's extra ones).

Only shapes and types here; value ranges are SamplingParams' job, so the two can't disagree.
Unknown fields are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's rule for function names (letters, digits, `_`, `-`; at most 64), plus `.`, which
# namespaced tool names use and vLLM accepts.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    thinking_token_budget: int | None = None
    logprobs_mode: Literal["raw", "processed"] = "raw"
    extra_args: dict[str, Any] | None = None
    # structured outputs, every shape vLLM takes (read by structured_outputs.py, which names
    # the field in its errors): OpenAI's, vLLM's object, and vLLM's older top-level names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # ignored: llguidance is the one backend


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(OpenAIModel):
    type: str
    text: str | None = None


class FunctionDefinition(OpenAIModel):
    name: str
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
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a `tool` message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # checked in serving_tools.py, for errors that name the field
    parallel_tool_calls: bool = True


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]

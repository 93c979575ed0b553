"""The neutral chat input: what a chat request asks of the model, in no wire format.

Each chat endpoint translates its request body into one `ChatInput` (OpenAI's chat completions:
`openai/chat_request.py`); the chat template, the tool plan, the structured-output check and the
sampling params read only this. A new wire format (Anthropic's Messages, OpenAI's Responses) is
a translator into it plus a formatter of the parsers' events (`nanoserve/parsers/events.py`).

A translation checks nothing and cannot fail: each value is checked where it is used, in the
order the chat endpoint always used, so a request with several mistakes is answered with the
same first one. Errors name the fields in chat completions' vocabulary (`messages.0.content`,
`tools.1.function.name`, `tool_choice`), which the OpenAI-compatible servers all share; the
tool choice and the response-format shapes are kept in that vocabulary for the same reason.

An image is a part of its own (`ContentPart(type="image", image_url=...)`) holding a URL as
the client sent it (`data:` or http(s)), or the data URL the translator made of bytes sent
bare (Anthropic's base64 source, Ollama's `images`); nothing is decoded or fetched here
(`serving/images.py` does that, once, for every wire format). Its `where` names the part as
the client wrote it, where that differs from chat completions' `messages.i.content.j`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ContentPart:
    """One part of a message's content: `text`, `image` (see the module), or a type no model
    here reads (refused by the template step, naming it)."""

    type: str
    text: str | None = None
    image_url: str | None = None  # an image: a data: or http(s) URL; None: the client gave none
    where: str | None = None  # the part's field path in the request; None: messages.i.content.j


@dataclass(frozen=True)
class ToolCallInput:
    """A call an earlier assistant turn made."""

    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass(frozen=True)
class MessageInput:
    """One turn of the conversation."""

    role: str  # "system", "developer", "user", "assistant", "tool", "function"
    content: str | tuple[ContentPart, ...] | None = None
    name: str | None = None
    tool_calls: tuple[ToolCallInput, ...] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    reasoning: str | None = None  # an assistant's earlier reasoning (`reasoning_content`)


def image_parts(messages: Sequence[MessageInput]) -> Iterator[tuple[str, ContentPart]]:
    """Every image part of the messages, in order, with the field path that names it."""
    for i, message in enumerate(messages):
        if isinstance(message.content, tuple):
            for j, part in enumerate(message.content):
                if part.type == "image":
                    yield part.where or f"messages.{i}.content.{j}", part


def data_url(base64_data: str, media_type: str = "") -> str:
    """Bytes a wire format sends bare, as the data URL an image part holds (Ollama's images
    carry no media type: `data:;base64,...`, as Ollama's own OpenAI layer takes them)."""
    return f"data:{media_type};base64,{base64_data}"


@dataclass(frozen=True)
class ToolFunction:
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object


@dataclass(frozen=True)
class ToolInput:
    """A tool: its function, and the tool as chat templates take it (transformers'
    `{"type": "function", "function": {...}}`, with every field the client gave)."""

    function: ToolFunction
    template: dict[str, Any]


# "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}; None: absent
ToolChoice = str | dict[str, Any] | None


@dataclass(frozen=True)
class ResponseFormatInput:
    """Every shape that constrains the output to a grammar (read by
    `serving/structured_outputs.py`): OpenAI's `response_format`, vLLM's `structured_outputs`
    object and vLLM's older `guided_*` names."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


@dataclass(frozen=True)
class StreamOptions:
    """What a streamed response adds: usage at the end, and with every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass(frozen=True)
class SamplingInput:
    """The sampling fields as the client gave them (ranges are checked by SamplingParams)."""

    n: int = 1
    max_tokens: int | None = None  # None: up to the context length
    # True: max_tokens is a cap held to the context's room (Anthropic's max_tokens, Ollama's
    # num_predict); False: past the room it is a 400 (vLLM's rule). serving/token_limits.py
    max_tokens_is_cap: bool = False
    context_limit: int | None = None  # a smaller context for this request (Ollama's num_ctx)
    context_field: str = "num_ctx"  # the client's name for that limit, for errors
    temperature: float | None = None
    # the wire format's own documented cap (Responses: 2, Messages: 1); None: vLLM's, none
    max_temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None  # -1 means none
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[str, float] | None = None  # token ids as JSON object keys (strings)
    logprobs: int | None = None  # top alternatives per output token; None: no logprobs
    logprobs_field: str = "logprobs"  # the client's name for that count, for errors
    prompt_logprobs: int | None = None
    # completions' echo with logprobs: the prompt's logprobs at that count where
    # prompt_logprobs does not ask (vLLM's echo; allowed while streaming, unlike the field)
    echo_logprobs: int | None = None
    logprobs_mode: str = "raw"
    thinking_token_budget: int | None = None
    extra_args: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's: only requests with this salt share cached blocks
    return_progress: bool = False  # llama-server's: a stream reports the prompt's progress
    priority: int = 0  # vLLM's (--scheduling-policy priority): lower first
    # llama.cpp's samplers the request set, by SamplingParams' names (llama_sampler_fields.py)
    llama_samplers: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    stream_options: StreamOptions | None = None


@dataclass(frozen=True)
class TemplateOptions:
    """The chat template's switches."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)


@dataclass(frozen=True)
class ChatInput:
    """One chat request, translated (see the module)."""

    messages: tuple[MessageInput, ...]
    tools: tuple[ToolInput, ...] | None = None
    tool_choice: ToolChoice = None
    is_parallel_tool_calls: bool = True
    response_format: ResponseFormatInput = field(default_factory=ResponseFormatInput)
    sampling: SamplingInput = field(default_factory=SamplingInput)
    template: TemplateOptions = field(default_factory=TemplateOptions)
    include_reasoning: bool = True  # split reasoning out (where the server has a parser)
    # how much to reason: "none" ... "xhigh" (serving/reasoning_options.py); None: not said
    reasoning_effort: str | None = None

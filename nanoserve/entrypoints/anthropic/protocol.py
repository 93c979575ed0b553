"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `.../count_tokens`).

Only shapes and types are checked here (a 400 naming the field, e.g.
`messages.0.content.1.tool_use.input`); ranges are SamplingParams' job, as on the OpenAI routes.
Unknown fields are accepted and ignored (`cache_control`, `citations`, `metadata`,
`service_tier`, `context_management`, ...): the SDK and Claude Code send many that change
nothing here. The sampling fields are typed although the current `anthropic` SDK sends them as
untyped extra body fields: on the wire they are the same top-level keys. Image blocks (a base64
or a URL source) are read, in user turns and tool results; document blocks parse (so the error
can name them) and are refused by the translation (`messages_request.py`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


def _text_blocks(value: Any) -> Any:
    """A string where blocks may stand is one text block (system, content, tool results)."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class AnthropicTextBlock(AnthropicModel):
    type: Literal["text"]
    text: str


class AnthropicBase64Source(AnthropicModel):
    type: Literal["base64"]
    media_type: str  # one of Anthropic's four image types (checked by messages_request.py)
    data: str


class AnthropicURLSource(AnthropicModel):
    type: Literal["url"]
    url: str


class AnthropicImageBlock(AnthropicModel):
    """An image: base64 bytes or a URL (checked and decoded by serving/images.py)."""

    type: Literal["image"]
    source: Annotated[AnthropicBase64Source | AnthropicURLSource, Field(discriminator="type")]


class AnthropicUnreadableBlock(AnthropicModel):
    """A block of a kind the models here cannot read: refused with a 400 naming it."""

    type: Literal["document", "search_result", "container_upload"]


class AnthropicToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[Annotated[AnthropicTextBlock | AnthropicImageBlock | AnthropicUnreadableBlock,
                            Field(discriminator="type")]] = []
    is_error: bool = False

    _blocks = field_validator("content", mode="before")(_text_blocks)


class AnthropicThinkingBlock(AnthropicModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicRedactedThinkingBlock(AnthropicModel):
    """Earlier reasoning that Anthropic encrypted: nothing here can read it, so it is dropped."""

    type: Literal["redacted_thinking"]


ContentBlock = Annotated[AnthropicTextBlock | AnthropicImageBlock | AnthropicUnreadableBlock
                         | AnthropicToolUseBlock | AnthropicToolResultBlock
                         | AnthropicThinkingBlock | AnthropicRedactedThinkingBlock,
                         Field(discriminator="type")]


class AnthropicMessage(AnthropicModel):
    # "system": Claude Code 2.1 sends its environment notes as a system turn after the first
    # user turn; it stays there (see messages_request.py)
    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock]

    _blocks = field_validator("content", mode="before")(_text_blocks)


class AnthropicTool(AnthropicModel):
    """A client tool. Anthropic's server tools (`web_search_20250305`, `bash_20250124`, ...)
    run on Anthropic's side, which this server is not: a 400 naming the tool."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} is one of Anthropic's server tools, which "
                             "this server does not run; give client tools (name, description, "
                             "input_schema)")
        return value


class AnthropicToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool, with type "tool"
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('tool_choice of type "tool" needs the name of the tool to use')
        return self


class AnthropicThinking(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class AnthropicOutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(AnthropicModel):
    format: AnthropicOutputFormat | None = None
    effort: str | None = None  # low, medium, high, max: a thinking budget (messages_request)


class CountTokensRequest(AnthropicModel):
    """What shapes the prompt: `count_tokens` counts exactly what `create` would prefill."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: list[AnthropicTextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra, as on chat completions

    _blocks = field_validator("system", mode="before")(_text_blocks)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # a cap: see serving_messages.py
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: AnthropicOutputConfig | None = None
    output_format: AnthropicOutputFormat | None = None  # the structured-outputs beta's name
    extra_args: dict[str, Any] | None = None  # for custom logits processors, as on chat
    ignore_eos: bool = False  # vLLM's extra sampling field (benchmarks: fixed-length output)
    seed: int | None = None  # vLLM's extra sampling field, as on chat completions

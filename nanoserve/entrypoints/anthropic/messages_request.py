"""A Messages body translated into the neutral `ChatInput` (`serving/chat_input.py`): after
this, nothing of the endpoint reads the pydantic request.

- `system` (a string or text blocks; Claude Code's billing line taken off its start,
  `billing_header.py`) is the first message; its blocks join as a message's text parts do. A
  system turn inside `messages` (Claude Code 2.1 sends one) stays where it is.
- A user turn's `tool_result` blocks become `tool` messages (in their order, text between them
  a user message), each naming the `tool_use` it answers; an assistant's `tool_use` blocks are
  its tool calls, its `thinking` its earlier reasoning (which templates do not get).
- `tool_choice`: auto → "auto", any → "required", tool → the named function, none → "none";
  `disable_parallel_tool_use` → one call at most.
- `thinking` → the template's `enable_thinking` (so a Qwen3-style template opens or closes its
  reasoning section) and, on a model with reasoning tags, `budget_tokens` as the thinking
  budget; absent, the template's default holds.
- `output_config.format` (or the beta's `output_format`) → a JSON-schema response format;
  `output_config.effort` (low, medium, high, max) → chat's `reasoning_effort` (max is xhigh),
  a thinking budget where `budget_tokens` gives none.
- `max_tokens` is a cap held to the room the context leaves (`max_tokens_is_cap`; see
  serving_messages.py for why).
- The sampling fields are checked by chat completions' code, with Anthropic's own cap on
  `temperature` (1); `seed` and `ignore_eos` are vLLM's extras, as on chat completions.

- An `image` block (base64 or url source) is an image part, in a user turn and inside a
  `tool_result` (Claude Code's Read tool puts screenshots there): as vLLM does, the tool
  message keeps the text and a user message after the turn's run of tool messages carries
  the images, in their order. Base64 becomes a data URL of its media type.

Unlike chat completions' translation, this one refuses what only this wire format can name:
document blocks, an image of a media type Anthropic's API does not take (`source.media_type`),
images where Anthropic takes none (assistant and system turns) and a `tool_result` that
answers no earlier `tool_use`, each a 400 naming the block.
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.entrypoints.anthropic.billing_header import strip_billing_header
from nanoserve.entrypoints.anthropic.protocol import (
    AnthropicImageBlock,
    AnthropicMessage,
    AnthropicTextBlock,
    AnthropicThinkingBlock,
    AnthropicTool,
    AnthropicToolResultBlock,
    AnthropicToolUseBlock,
    AnthropicUnreadableBlock,
    AnthropicURLSource,
    CountTokensRequest,
    MessagesRequest,
)
from nanoserve.entrypoints.serving.chat_input import (
    ChatInput,
    ContentPart,
    MessageInput,
    ResponseFormatInput,
    SamplingInput,
    TemplateOptions,
    ToolCallInput,
    ToolChoice,
    ToolFunction,
    ToolInput,
    data_url,
)
from nanoserve.entrypoints.serving.errors import bad_request

MAX_TEMPERATURE = 1.0  # Anthropic's documented range for `temperature` is [0, 1]
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # Anthropic's API's


def messages_input(req: CountTokensRequest, *, strip_billing: bool = True,
                   has_reasoning_tokens: bool = False) -> ChatInput:
    """The request as the neutral chat input (a `CountTokensRequest` gives the same prompt as
    the `MessagesRequest` it counts, and default sampling)."""
    sampling, response_format, effort = SamplingInput(), ResponseFormatInput(), None
    if isinstance(req, MessagesRequest):
        effort = _effort(req)
        budget = req.thinking.budget_tokens if req.thinking is not None else None
        sampling = SamplingInput(
            max_tokens=req.max_tokens, max_tokens_is_cap=True,
            temperature=req.temperature, max_temperature=MAX_TEMPERATURE,
            top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=req.stop_sequences,
            thinking_token_budget=budget if has_reasoning_tokens else None,
            ignore_eos=req.ignore_eos, extra_args=req.extra_args, stream=req.stream)
        response_format = _response_format(req)
    choice = req.tool_choice
    last = req.messages[-1]  # an assistant's text last is a prefill the answer continues
    is_prefill = last.role == "assistant" and not any(
        isinstance(block, AnthropicToolUseBlock) for block in last.content) and any(
        isinstance(block, AnthropicTextBlock) and block.text for block in last.content)
    return ChatInput(
        messages=_system(req.system, strip_billing) + _messages(req.messages),
        tools=None if req.tools is None else tuple(_tool(tool) for tool in req.tools),
        tool_choice=_tool_choice(req),
        is_parallel_tool_calls=not (choice is not None and choice.disable_parallel_tool_use),
        response_format=response_format, sampling=sampling,
        template=TemplateOptions(add_generation_prompt=not is_prefill,
                                 continue_final_message=is_prefill,
                                 kwargs=_template_kwargs(req)),
        reasoning_effort=effort)


_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "xhigh"}


def _effort(req: MessagesRequest) -> str | None:
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is None:
        return None
    if effort not in _EFFORTS:
        raise bad_request(f"output_config.effort must be one of {', '.join(_EFFORTS)}, got "
                          f"{effort!r}", "output_config.effort")
    return _EFFORTS[effort]


def _system(blocks: list[AnthropicTextBlock] | None,
            strip_billing: bool) -> tuple[MessageInput, ...]:
    texts = [block.text for block in blocks or []]
    if strip_billing:
        texts = strip_billing_header(texts)
    if not texts:
        return ()
    return (MessageInput("system", tuple(ContentPart("text", text) for text in texts)),)


def _messages(messages: list[AnthropicMessage]) -> tuple[MessageInput, ...]:
    out: list[MessageInput] = []
    call_ids: set[str] = set()  # the tool_use blocks so far, which tool results answer
    for i, message in enumerate(messages):
        if message.role == "assistant":
            out.append(_assistant(message, i))
            call_ids.update(call.id for call in out[-1].tool_calls or ())
        elif message.role == "system":
            out.append(_system_turn(message, i))
        else:
            out.extend(_user(message, i, call_ids))
    return tuple(out)


def _assistant(message: AnthropicMessage, index: int) -> MessageInput:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallInput] = []
    for j, block in enumerate(message.content):
        if isinstance(block, AnthropicTextBlock):
            texts.append(block.text)
        elif isinstance(block, AnthropicThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, AnthropicToolUseBlock):
            calls.append(ToolCallInput(block.id, block.name, json.dumps(block.input)))
        elif isinstance(block, AnthropicUnreadableBlock | AnthropicToolResultBlock
                        | AnthropicImageBlock):
            raise _refused(block, f"messages.{index}.content.{j}", "an assistant's")
    return MessageInput("assistant", "".join(texts) or None, tool_calls=tuple(calls) or None,
                        reasoning="".join(reasoning) or None)


def _system_turn(message: AnthropicMessage, index: int) -> MessageInput:
    """A system turn inside the conversation, kept where it is: moved up into the system
    prompt it would change the prompt's prefix whenever it changes."""
    parts = []
    for j, block in enumerate(message.content):
        if not isinstance(block, AnthropicTextBlock):
            raise _refused(block, f"messages.{index}.content.{j}", "a system turn's")
        parts.append(ContentPart("text", block.text))
    return MessageInput("system", tuple(parts))


def _user(message: AnthropicMessage, index: int, call_ids: set[str]) -> list[MessageInput]:
    """The turn's text and images, and a `tool` message per tool result, in their order. A
    tool result's images follow its run of tool messages in a user message (vLLM's way:
    templates take images in user turns; the run stays unbroken, as templates group it)."""
    out: list[MessageInput] = []
    parts: list[ContentPart] = []
    tool_images: list[ContentPart] = []  # of the tool results since the last user part
    for j, block in enumerate(message.content):
        where = f"messages.{index}.content.{j}"
        if isinstance(block, AnthropicToolResultBlock):
            if parts:
                out.append(MessageInput("user", tuple(parts)))
                parts = []
            tool, images = _tool_result(block, where, call_ids)
            out.append(tool)
            tool_images += images
            continue
        parts += tool_images
        tool_images = []
        if isinstance(block, AnthropicTextBlock):
            parts.append(ContentPart("text", block.text))
        elif isinstance(block, AnthropicImageBlock):
            parts.append(_image(block, where))
        elif isinstance(block, AnthropicUnreadableBlock | AnthropicToolUseBlock
                        | AnthropicThinkingBlock):
            raise _refused(block, where, "a user's")
    parts += tool_images
    if parts or not out:
        out.append(MessageInput("user", tuple(parts)))
    return out


def _tool_result(block: AnthropicToolResultBlock, where: str,
                 call_ids: set[str]) -> tuple[MessageInput, list[ContentPart]]:
    """The tool message (its text) and the result's images, in their order."""
    if block.tool_use_id not in call_ids:
        raise bad_request(f"{where}.tool_use_id: {block.tool_use_id!r} answers no tool_use "
                          "block of an earlier assistant message", f"{where}.tool_use_id")
    texts, images = [], []
    for k, part in enumerate(block.content):
        if isinstance(part, AnthropicUnreadableBlock):
            raise _refused(part, f"{where}.content.{k}", "a tool result's")
        if isinstance(part, AnthropicImageBlock):
            images.append(_image(part, f"{where}.content.{k}"))
        else:
            texts.append(part.text)
    return MessageInput("tool", "\n".join(texts), tool_call_id=block.tool_use_id), images


def _image(block: AnthropicImageBlock, where: str) -> ContentPart:
    """An image block as the neutral image part: a URL as it is, base64 as a data URL of one
    of the media types Anthropic's API takes."""
    source = block.source
    if isinstance(source, AnthropicURLSource):
        return ContentPart("image", image_url=source.url, where=where)
    if source.media_type not in MEDIA_TYPES:
        raise bad_request(f"{where}.source.media_type: {source.media_type!r} is not supported; "
                          f"send one of {', '.join(MEDIA_TYPES)}", f"{where}.source.media_type")
    return ContentPart("image", image_url=data_url(source.data, source.media_type), where=where)


def _refused(block: Any, where: str, whose: str) -> Exception:
    reason = ("this server reads text and images only"
              if isinstance(block, AnthropicUnreadableBlock)
              else "Anthropic's API does not take it there either")
    return bad_request(f"{where}: {block.type} blocks are not supported in {whose} content; "
                       f"{reason}", where)


def _tool(tool: AnthropicTool) -> ToolInput:
    function = ToolFunction(tool.name, tool.description, tool.input_schema)
    template: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        template["description"] = tool.description
    return ToolInput(function, template={"type": "function", "function": template})


def _tool_choice(req: CountTokensRequest) -> ToolChoice:
    choice = req.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _template_kwargs(req: CountTokensRequest) -> dict[str, Any] | None:
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    kwargs.update(req.chat_template_kwargs or {})  # the client's own word wins
    return kwargs or None


def _response_format(req: MessagesRequest) -> ResponseFormatInput:
    output_format = req.output_config.format if req.output_config is not None else None
    output_format = output_format or req.output_format
    if output_format is None:
        return ResponseFormatInput()
    return ResponseFormatInput(response_format={
        "type": "json_schema",
        "json_schema": {"name": "output_format", "schema": output_format.json_schema}})

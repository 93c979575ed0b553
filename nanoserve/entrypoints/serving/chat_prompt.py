"""The prompt of a chat input: its messages and tools through the chat template, with the
template's switches. Tool calling's prompt side lives here: the tools as templates take them,
and an earlier turn's calls and a tool result's call id as templates read them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from nanoserve.entrypoints.serving.chat_input import ChatInput, MessageInput, ToolInput
from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.gemma4_template import (
    generation_prompt,
    template_messages,
    template_text,
)
from nanoserve.entrypoints.serving.harmony_template import (
    harmony_messages,
    harmony_prompt,
    harmony_tools,
)
from nanoserve.entrypoints.serving.images import too_many_images
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.entrypoints.serving.tool_prompt import describe_tools

# what a model without a chat template (a base model, such as Gemma 3 270M's GGUF) answers on
# every chat route, with what would make chat work and what works without it
NO_CHAT_TEMPLATE = (
    "this model has no chat template, so it cannot render chat messages: serve it with "
    "--chat-template FILE (a Jinja chat template), or, in a --models-dir, put NAME.jinja beside "
    "NAME.gguf; /v1/completions and Ollama's /api/generate complete a prompt without one")


def render_prompt(ctx: ServerContext, chat: ChatInput) -> str:
    """The chat template applied to the messages, with the request's template switches."""
    if not ctx.has_chat_template:
        raise bad_request(NO_CHAT_TEMPLATE, "messages")
    options = chat.template
    if options.add_generation_prompt and options.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be "
                          "true", "continue_final_message")
    kwargs = dict(options.kwargs or {})
    if "chat_template" in kwargs:  # request-supplied templates run arbitrary Jinja
        raise bad_request("chat_template_kwargs may not replace the chat template",
                          "chat_template_kwargs")
    messages = message_dicts(chat.messages, ctx.accepts_images)
    if options.continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs a final assistant message",
                          "continue_final_message")
    if chat.tools is not None:
        kwargs["tools"] = template_tools(chat.tools)
    if not ctx.template_reads_tools:  # the template would drop them (tool_prompt.py)
        shown = kwargs.pop("tools", None) if chat.tool_choice != "none" else None
        messages = describe_tools(messages, shown)
    if ctx.chat_template is not None:
        kwargs["chat_template"] = ctx.chat_template
    template = template_text(ctx.chat_template, ctx.tokenizer)
    messages = template_messages(template, messages)  # Gemma 4's older templates' tool results
    messages = harmony_messages(template, messages)  # gpt-oss's: `thinking`, one call each
    if "tools" in kwargs:
        kwargs["tools"] = harmony_tools(template, kwargs["tools"])
    try:
        prompt = str(ctx.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **kwargs))
    except Exception as e:  # jinja errors, raise_exception() in templates
        raise bad_request(f"the chat template could not render these messages: {e}",
                          "messages") from None
    prompt = harmony_prompt(template, prompt, options.add_generation_prompt)
    return generation_prompt(template, prompt, options.add_generation_prompt)


def message_dicts(messages: Sequence[MessageInput],
                  accepts_images: bool = False) -> list[dict[str, Any]]:
    """The messages as chat templates take them: text content, a name, tool fields, an
    assistant's earlier reasoning as `reasoning_content` (as vLLM passes it: Qwen3.5's
    template writes it back in the turn's <think> section). Text parts join into one string;
    a message with images, on a model that takes them, keeps its parts as a list in order,
    `{"type": "text", "text": ...}` and `{"type": "image"}` (what Gemma 3's and Qwen's
    templates read). A model that takes no images gets vLLM's count error for the first."""
    out = []
    for i, message in enumerate(messages):
        entry: dict[str, Any] = {"role": message.role,
                                 "content": _content(message, i, accepts_images)}
        if message.name is not None:
            entry["name"] = message.name
        if message.reasoning and message.role == "assistant":
            entry["reasoning_content"] = message.reasoning
        entry.update(tool_message_fields(message, i))
        out.append(entry)
    return out


def _content(message: MessageInput, index: int, accepts_images: bool) -> str | list[Any]:
    content = message.content
    if not isinstance(content, tuple):
        return content or ""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = part.where or f"messages.{index}.content.{j}"
        if part.type == "image":
            if not accepts_images:
                raise bad_request(too_many_images(0, False), where)
            parts.append({"type": "image"})
        elif part.type == "text" and part.text is not None:
            parts.append({"type": "text", "text": part.text})
        else:
            raise bad_request(f"content part type {part.type!r} is not supported; this "
                              "server reads text and images", where)
    if any(part["type"] == "image" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def template_tools(tools: Sequence[ToolInput] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (`apply_chat_template(..., tools=...)`)."""
    return None if tools is None else [tool.template for tool in tools]


def tool_message_fields(message: MessageInput, index: int) -> dict[str, Any]:
    """An earlier turn's `tool_calls` and a tool message's `tool_call_id`, as templates read
    them: arguments as objects, not JSON text (vLLM parses them the same way)."""
    fields: dict[str, Any] = {}
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise bad_request(f"only assistant messages carry tool_calls, not {message.role!r}",
                              f"messages.{index}.tool_calls")
        calls = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.arguments)
            except json.JSONDecodeError as e:
                raise bad_request(f"arguments must be JSON text: {e}",
                                  f"messages.{index}.tool_calls.{j}.function.arguments") from None
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.name, "arguments": arguments}})
        fields["tool_calls"] = calls
    if message.role == "tool":
        if message.tool_call_id is None:
            raise bad_request("a tool message needs tool_call_id, the id of the call it answers",
                              f"messages.{index}.tool_call_id")
        fields["tool_call_id"] = message.tool_call_id
    return fields

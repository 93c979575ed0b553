"""OpenAI's chat-completions body translated into the neutral `ChatInput`: after this, nothing
of the chat endpoint reads the pydantic request. The translation checks nothing (see
`chat_input.py`); an assistant's earlier reasoning is read from vLLM's `reasoning_content`
or `reasoning`; an `image_url` part is an image part holding its URL as sent."""

from __future__ import annotations

from nanoserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    ContentPartModel,
)
from nanoserve.entrypoints.openai.request_fields import response_format_input, sampling_input
from nanoserve.entrypoints.serving.chat_input import (
    ChatInput,
    ContentPart,
    MessageInput,
    TemplateOptions,
    ToolCallInput,
    ToolFunction,
    ToolInput,
)


def chat_input(req: ChatCompletionRequest) -> ChatInput:
    asked = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    return ChatInput(
        messages=tuple(_message(message) for message in req.messages),
        tools=None if req.tools is None else tuple(_tool(tool) for tool in req.tools),
        tool_choice=req.tool_choice, is_parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format_input(req),
        sampling=sampling_input(req, max_tokens=asked,
                                logprobs=(req.top_logprobs or 0) if req.logprobs else None),
        template=TemplateOptions(req.add_generation_prompt, req.continue_final_message,
                                 req.chat_template_kwargs),
        include_reasoning=req.include_reasoning, reasoning_effort=req.reasoning_effort)


def _message(message: ChatMessage) -> MessageInput:
    content = message.content
    return MessageInput(
        role=message.role,
        content=tuple(_part(part) for part in content) if isinstance(content, list) else content,
        name=message.name,
        tool_calls=None if message.tool_calls is None else tuple(
            ToolCallInput(call.id, call.function.name, call.function.arguments)
            for call in message.tool_calls),
        tool_call_id=message.tool_call_id,
        reasoning=message.reasoning_content or message.reasoning)


def _part(part: ContentPartModel) -> ContentPart:
    """An `image_url` part as the neutral image part (its URL as sent, or None: checked where
    it is read); any other part as it is."""
    if part.type != "image_url":
        return ContentPart(part.type, part.text)
    url = part.image_url.url if not isinstance(part.image_url, str | None) else part.image_url
    return ContentPart("image", image_url=url)


def _tool(tool: ChatTool) -> ToolInput:
    function = tool.function
    return ToolInput(ToolFunction(function.name, function.description, function.parameters),
                     template=tool.model_dump(exclude_none=True))

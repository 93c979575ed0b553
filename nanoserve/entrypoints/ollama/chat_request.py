"""Ollama's chat and generate bodies translated into the neutral `ChatInput`
(`entrypoints/serving/chat_input.py`): after this, nothing reads the pydantic request but the output
caps' first checks (`output_caps.py`).

- `/api/chat` `messages`: each role as it is; an assistant's `tool_calls` (arguments as an
  object) and `thinking` (its earlier reasoning, which templates do not get). Ollama's calls
  carry no ids and its tool results name the function (`tool_name`), while templates pair a
  result with a call id; so each call gets an id (its own, or `call_<turn>_<index>`) and each
  tool result answers the earliest unanswered call of its function (or of any, unnamed).
- `/api/generate`: `system` and `prompt` as a system and a user turn through the chat template,
  as Ollama renders them; with `raw` the prompt goes to the model as it is (the serving side).
- `tools` → tools with the choice left to the model ("auto"), as Ollama has no tool choice.
- `format`: "json" → any JSON object, a schema → that schema ("" or none: free text).
- `options` → the sampling fields (`repeat_penalty` is `repetition_penalty`; a seed of -1 means
  none); the model's generation defaults stand for what is absent, as on the other routes.
- `think`: true or a level ("high", "medium", "low": gpt-oss's) → the template's
  `enable_thinking`, false → `enable_thinking=False` (vLLM's `chat_template_kwargs`); absent,
  the template's default. A level is also the reasoning effort (a thinking budget:
  `serving/reasoning_options.py`), false the effort "none". A model without a reasoning
  parser refuses `think` true with Ollama's 400, `"<model>" does not support thinking`; false
  is accepted for any model.

- `images` (raw base64, a message's or generate's): image parts after the turn's text (data
  URLs without a media type, checked where they are read: `serving/images.py`).

Refused with a 400 naming the field, as only this wire format can ask for them: `images` with
`raw` (images need the chat template), `suffix` with `raw` (a suffix needs the
fill-in-the-middle prompt built from the model's FIM tokens, ollama/serving.py) and `template`
(a Go template; the model's own Jinja template is used, and `raw` sends a prompt of the
client's own).
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.entrypoints.ollama.output_caps import UP_TO_CONTEXT
from nanoserve.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
    OllamaTool,
)
from nanoserve.entrypoints.serving.chat_input import (
    ChatInput,
    ContentPart,
    MessageInput,
    ResponseFormatInput,
    SamplingInput,
    TemplateOptions,
    ToolCallInput,
    ToolFunction,
    ToolInput,
    data_url,
)
from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.llama_sampler_fields import (
    llama_samplers,
    with_llama_defaults,
)


def chat_input(req: OllamaChatRequest, model: str, can_think: bool) -> ChatInput:
    """A chat body with at least one message, as the neutral chat input."""
    messages = req.messages or []
    return ChatInput(
        messages=_messages(messages),
        tools=tuple(_tool(tool) for tool in req.tools) if req.tools else None,  # [] is none
        response_format=response_format(req.format), sampling=sampling_input(req),
        template=TemplateOptions(kwargs=template_kwargs(req.think, model, can_think)),
        reasoning_effort=reasoning_effort(req.think))


def generate_input(req: OllamaGenerateRequest, model: str, can_think: bool) -> ChatInput:
    """A generate body with a prompt, as a one-turn chat (with `raw`, only its sampling and
    format are read: the prompt is sent as it is)."""
    if req.images and req.raw:
        raise bad_request("images need the chat template, which raw: true skips; send them "
                          "without raw", "images")
    if req.suffix and req.raw:
        raise bad_request("suffix needs the fill-in-the-middle prompt this server builds, which "
                          "raw: true skips; send one of them", "suffix")
    if req.template:
        raise bad_request("template is not supported: prompts are rendered with the model's "
                          "own chat template; send raw: true with a prompt of your own instead",
                          "template")
    turns = [MessageInput("system", req.system)] if req.system else []
    turns.append(MessageInput("user", _with_images(req.prompt, req.images, "images")))
    return ChatInput(messages=tuple(turns), response_format=response_format(req.format),
                     sampling=sampling_input(req),
                     template=TemplateOptions(kwargs=template_kwargs(req.think, model,
                                                                     can_think)),
                     reasoning_effort=reasoning_effort(req.think))


def sampling_input(req: OllamaChatRequest | OllamaGenerateRequest) -> SamplingInput:
    """`options` as the sampling fields; `num_predict` a cap on the output held to the
    context's room, `num_ctx` a smaller context (`output_caps.py`)."""
    options = req.options or OllamaOptions()
    asked = options.num_predict
    return SamplingInput(
        max_tokens=None if asked in UP_TO_CONTEXT else asked, max_tokens_is_cap=True,
        context_limit=options.num_ctx, context_field="options.num_ctx",
        temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
        min_p=options.min_p, repetition_penalty=options.repeat_penalty,
        presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
        seed=options.seed, stop=options.stop or None, stream=req.stream,
        llama_samplers=with_llama_defaults(llama_samplers(options)))


def response_format(value: str | dict[str, Any] | None) -> ResponseFormatInput:
    if value is None or value == "":
        return ResponseFormatInput()
    if value == "json":
        return ResponseFormatInput(response_format={"type": "json_object"})
    if isinstance(value, str):
        raise bad_request(f'format must be "json" or a JSON schema object, got {value!r}',
                          "format")
    return ResponseFormatInput(response_format={
        "type": "json_schema", "json_schema": {"name": "format", "schema": value}})


def template_kwargs(think: bool | str | None, model: str,
                    can_think: bool) -> dict[str, Any] | None:
    if think is None:
        return None
    if isinstance(think, str) and think not in ("high", "medium", "low"):
        raise bad_request(f'think must be true, false, "high", "medium" or "low", got '
                          f"{think!r}", "think")
    if think is False:
        return {"enable_thinking": False}
    if not can_think:
        raise bad_request(f'"{model}" does not support thinking (the server has no '
                          "--reasoning-parser for it)", "think")
    return {"enable_thinking": True}


def reasoning_effort(think: bool | str | None) -> str | None:
    """`think`'s level as the effort (checked by `template_kwargs` first); true: no cap."""
    if think is False:
        return "none"
    return think if isinstance(think, str) else None


def _messages(messages: list[OllamaMessage]) -> tuple[MessageInput, ...]:
    out: list[MessageInput] = []
    unanswered: list[tuple[str, str]] = []  # (call id, function name) of calls so far
    for i, message in enumerate(messages):
        calls = None
        if message.tool_calls:
            calls = tuple(_call(call.id or f"call_{i}_{j}", call.function.name,
                                call.function.arguments)
                          for j, call in enumerate(message.tool_calls))
            unanswered += [(call.id, call.name) for call in calls]
        call_id = message.tool_call_id
        if message.role == "tool" and call_id is None:
            call_id = _answered(unanswered, message.tool_name) or f"call_{i}"
        content = _with_images(message.content, message.images, f"messages.{i}.images") \
            if message.images else message.content
        out.append(MessageInput(message.role, content, tool_calls=calls,
                                tool_call_id=call_id if message.role == "tool" else None,
                                reasoning=message.thinking))
    return tuple(out)


def _with_images(text: str | None, images: list[str] | None,
                 where: str) -> str | tuple[ContentPart, ...]:
    """A turn's text, then its images (raw base64, as Ollama sends them: data URLs with no
    media type; a data URL sent as it is stays one)."""
    if not images:
        return text or ""
    parts = [ContentPart("text", text)] if text else []
    parts += [ContentPart("image", image_url=image if image.startswith("data:")
                          else data_url(image), where=f"{where}.{k}")
              for k, image in enumerate(images)]
    return tuple(parts)


def _answered(unanswered: list[tuple[str, str]], name: str | None) -> str | None:
    """The id of the earliest unanswered call of `name` (or of any call), now answered."""
    for k, (call_id, call_name) in enumerate(unanswered):
        if name is None or call_name == name:
            del unanswered[k]
            return call_id
    return None


def _call(call_id: str, name: str, arguments: dict[str, Any] | str) -> ToolCallInput:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCallInput(call_id, name, text)


def _tool(tool: OllamaTool) -> ToolInput:
    function = tool.function
    template: dict[str, Any] = {"name": function.name}
    if function.description is not None:
        template["description"] = function.description
    if function.parameters is not None:
        template["parameters"] = function.parameters
    return ToolInput(ToolFunction(function.name, function.description, function.parameters),
                     template={"type": "function", "function": template})

"""A Responses API body translated into the neutral `ChatInput` (`serving/chat_input.py`).

Unlike chat completions' translation, this one reads items whose shape only their `type` tells,
so it checks each item as it reads it and answers a 400 naming the field as the client wrote it
(`input.3.arguments`, `tools.2.name`). The shared checks after it (the tool plan, the template,
structured outputs, the token limits) name fields in chat completions' vocabulary; `renamed()`
turns their errors back into this API's names.

- `instructions` becomes a first system message; `input` a string (one user turn) or items.
  An assistant turn is gathered from consecutive `reasoning`, assistant `message` and
  `function_call` items (as a chat completion's one assistant message carries its content and
  its calls); a `function_call_output` is a tool message (its images, as vLLM moves them, a
  user message after it).
- `input_image` parts are image parts holding their `image_url` (a data: or http(s) URL,
  checked where it is read: `serving/images.py`); `file_id` is refused: no files are stored.
- Function tools are offered to the model; every other tool type (`web_search`, `file_search`,
  `local_shell`, `custom`, `namespace`, MCP, ...) is hosted by OpenAI or needs its own output
  format, and is left out with one log line, never a 400 (Codex sends several).
- `text.format` becomes chat's `response_format`; `max_output_tokens` its `max_tokens`;
  `reasoning.effort` its `reasoning_effort`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from nanoserve.entrypoints.openai.protocol import FunctionDefinition
from nanoserve.entrypoints.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputPart,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from nanoserve.entrypoints.serving.chat_input import (
    ChatInput,
    ContentPart,
    MessageInput,
    ResponseFormatInput,
    SamplingInput,
    ToolCallInput,
    ToolChoice,
    ToolFunction,
    ToolInput,
)
from nanoserve.entrypoints.serving.errors import APIError, bad_request

logger = logging.getLogger("nanoserve")

_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
_CHOICE_FORM = '"auto", "none", "required" or {"type": "function", "name": "..."}'
MAX_TEMPERATURE = 2.0  # OpenAI's documented range for `temperature` here is [0, 2]
_STATELESS = ("this server is stateless and keeps no responses; send the whole conversation as "
              "input (Codex does)")


@dataclass(frozen=True)
class ResponsesInput:
    """The neutral chat input, and where its tools came from (for error names)."""

    chat: ChatInput
    tool_indices: tuple[int, ...] = ()  # chat tool i is the request's tools[tool_indices[i]]


def responses_input(req: ResponsesRequest) -> ResponsesInput:
    """The translation (see the module); raises a 400 naming the field at fault."""
    _check_stateless(req)
    messages = [MessageInput("system", req.instructions)] if req.instructions is not None \
        else []
    messages += _messages(req.input)
    tools, indices = _tools(req.tools)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens must be >= 1, got {req.max_output_tokens}",
                          "max_output_tokens")
    chat = ChatInput(
        messages=tuple(messages), tools=tools, tool_choice=_tool_choice(req.tool_choice),
        is_parallel_tool_calls=req.parallel_tool_calls,
        response_format=ResponseFormatInput(
            response_format=_response_format(req.text.format if req.text else None)),
        sampling=SamplingInput(max_tokens=req.max_output_tokens, temperature=req.temperature,
                               max_temperature=MAX_TEMPERATURE,
                               top_p=req.top_p, ignore_eos=req.ignore_eos,
                               cache_salt=req.cache_salt, priority=req.priority,
                               stream=req.stream),
        reasoning_effort=_effort(req.reasoning))
    return ResponsesInput(chat, indices)


def _effort(reasoning: dict[str, Any] | None) -> str | None:
    """`reasoning.effort` (its values are checked with chat's `reasoning_effort`)."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request(f"reasoning.effort must be a string, got {type(effort).__name__}",
                          "reasoning.effort")
    return effort


def _check_stateless(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise bad_request(f"previous_response_id is not supported: {_STATELESS}",
                          "previous_response_id")
    if req.conversation is not None:
        raise bad_request(f"conversation is not supported: {_STATELESS}", "conversation")
    if req.background:
        raise bad_request(f"background must be false: {_STATELESS}", "background")


def _messages(raw: Any) -> list[MessageInput]:
    if isinstance(raw, str):
        return [MessageInput("user", raw)]
    if not isinstance(raw, list) or not raw:
        shown = "an empty array" if raw == [] else type(raw).__name__
        raise bad_request(f"input must be a string or a non-empty array of items, got {shown}",
                          "input")
    turns = _Turns()
    for i, item in enumerate(raw):
        turns.add(_item(item, i), i)
    return turns.finish()


def _item(raw: Any, i: int) -> BaseModel:
    if not isinstance(raw, dict):
        raise bad_request(f"input.{i} must be an item object, got {type(raw).__name__}",
                          f"input.{i}")
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(f"input.{i}.type {kind!r} is not supported; items may be "
                          + ", ".join(_ITEMS) + " (item_reference needs stored responses: "
                          + _STATELESS + ")", f"input.{i}.type")
    return _validated(model, raw, f"input.{i}")


def _validated(model: type[BaseModel], raw: dict[str, Any], where: str) -> Any:
    """`raw` as `model`; pydantic's first complaint as a 400 naming `where.<field>`."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field_name = ".".join([where, *(str(x) for x in first["loc"])])
        shown = "" if first["type"] == "missing" else f", got {first['input']!r:.80}"
        raise bad_request(f"{field_name}: {first['msg']}{shown}", field_name) from None


@dataclass
class _Turns:
    """Items into messages; an assistant turn is gathered until another kind of item."""

    messages: list[MessageInput] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    content: str | tuple[ContentPart, ...] | None = None
    calls: list[ToolCallInput] = field(default_factory=list)

    def add(self, item: BaseModel, i: int) -> None:
        where = f"input.{i}"
        if isinstance(item, ReasoningItem):
            if self.content is not None or self.calls:
                self._flush()
            text = "\n".join(_texts(item.content or item.summary, where))
            if text:
                self.reasoning.append(text)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            if self.content is not None or self.calls:
                self._flush()
            self.content = _content(item.content, f"{where}.content")
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except json.JSONDecodeError as e:
                raise bad_request(f"{where}.arguments must be JSON text: {e}",
                                  f"{where}.arguments") from None
            self.calls.append(ToolCallInput(item.call_id, item.name, item.arguments))
        elif isinstance(item, FunctionCallOutputItem):
            self._flush()
            output = _content(item.output, f"{where}.output")
            images: tuple[ContentPart, ...] = ()
            if isinstance(output, tuple):  # a tool result's text parts, as one text
                images = tuple(part for part in output if part.type == "image")
                output = "\n".join(part.text or "" for part in output if part.type == "text")
            self.messages.append(MessageInput("tool", output, tool_call_id=item.call_id))
            if images:  # as vLLM: the tool's text, then its images in a user turn
                self.messages.append(MessageInput("user", images))
        else:
            assert isinstance(item, MessageItem)
            self._flush()
            self.messages.append(MessageInput(item.role, _content(item.content,
                                                                  f"{where}.content")))

    def _flush(self) -> None:
        """The assistant turn gathered so far (reasoning alone makes no turn)."""
        if self.content is not None or self.calls:
            self.messages.append(MessageInput(
                "assistant", self.content, tool_calls=tuple(self.calls) or None,
                reasoning="\n".join(self.reasoning) or None))
        self.reasoning, self.content, self.calls = [], None, []

    def finish(self) -> list[MessageInput]:
        self._flush()
        return self.messages


def _content(content: Any, where: str) -> str | tuple[ContentPart, ...]:
    """A message's content as the neutral input takes it: a string, or text and image
    parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content parts, got "
                          f"{type(content).__name__}", where)
    return tuple(_parts(content, where))


def _texts(parts: list[Any], where: str) -> list[str]:
    """The text of each part (reasoning's); a part that is not text is a 400 naming it."""
    texts = []
    for part in _parts(parts, where, images=False):
        assert part.text is not None
        texts.append(part.text)
    return texts


def _parts(parts: list[Any], where: str, images: bool = True) -> list[ContentPart]:
    """Each part as a neutral text or image part; another type is a 400 naming it."""
    out = []
    for j, raw in enumerate(parts):
        if not isinstance(raw, InputPart | dict):
            raise bad_request(f"{where}.{j} must be a content part object, got "
                              f"{type(raw).__name__}", f"{where}.{j}")
        part = raw if isinstance(raw, InputPart) else _validated(InputPart, raw, f"{where}.{j}")
        if part.type == "input_image" and images:
            out.append(_image(part, f"{where}.{j}"))
            continue
        if part.type not in _TEXT_PARTS:
            allowed = "input_text, output_text, input_image" if images else "text"
            raise bad_request(f"{where}.{j}.type {part.type!r} is not supported here; "
                              f"send {allowed}", f"{where}.{j}.type")
        text = part.refusal if part.type == "refusal" else part.text
        if text is None:
            raise bad_request(f"{where}.{j} has no text", f"{where}.{j}.text")
        out.append(ContentPart("text", text))
    return out


def _image(part: InputPart, where: str) -> ContentPart:
    """An `input_image` part: its `image_url` (a URL, checked where it is read)."""
    if part.file_id is not None and part.image_url is None:
        raise bad_request(f"{where}.file_id is not supported; send the image as image_url "
                          "(a data: URL, base64)", f"{where}.file_id")
    url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
    return ContentPart("image", image_url=url if isinstance(url, str) else None, where=where)


def _tools(raw: list[dict[str, Any]] | None) -> tuple[tuple[ToolInput, ...] | None,
                                                     tuple[int, ...]]:
    """The function tools, and their places in `tools`; other types are left out."""
    tools: list[ToolInput] = []
    indices: list[int] = []
    ignored: list[str] = []
    for i, tool in enumerate(raw or []):
        if tool.get("type") != "function":
            ignored.append(str(tool.get("type")))
            continue
        spec: dict[str, Any] = {key: tool[key] for key in _FUNCTION_FIELDS if key in tool}
        function = _validated(FunctionDefinition, spec, f"tools.{i}")
        template = {"type": "function", "function": function.model_dump(exclude_none=True)}
        tools.append(ToolInput(ToolFunction(function.name, function.description,
                                            function.parameters), template))
        indices.append(i)
    if ignored:
        logger.info("/v1/responses: left out %d tools of types %s (only function tools are "
                    "offered to the model)", len(ignored), ", ".join(sorted(set(ignored))))
    return (tuple(tools) or None), tuple(indices)


def _tool_choice(choice: Any) -> ToolChoice:
    """Responses' `{"type": "function", "name"}` as chat's `{"type": "function",
    "function": {"name"}}`; the string forms as they are (tool_plan.py checks the rest)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
        raise bad_request(f"tool_choice of type {choice.get('type')!r} is not supported (this "
                          f"server offers function tools only); use {_CHOICE_FORM}",
                          "tool_choice")
    raise bad_request(f"tool_choice must be {_CHOICE_FORM}, got {json.dumps(choice):.80}",
                      "tool_choice")


def _response_format(text_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (its checks: structured_outputs.py)."""
    if text_format is None or text_format.get("type") != "json_schema":
        return text_format
    spec = {key: text_format[key] for key in ("name", "schema", "strict", "description")
            if key in text_format}
    return {"type": "json_schema", "json_schema": spec}


# chat completions' field names in the shared checks' errors, and this API's (longest first)
_FIELD_NAMES = (("response_format.json_schema", "text.format"),
                ("response_format", "text.format"),
                ("'max_tokens' or 'max_completion_tokens'", "max_output_tokens"),
                ("max_tokens", "max_output_tokens"),
                ("reasoning_effort", "reasoning.effort"))
_TOOL_FIELD = re.compile(r"tools\.(\d+)\.function\.")


def renamed(error: APIError, translated: ResponsesInput) -> APIError:
    """A shared check's error with the fields named as this API names them."""
    def rename(text: str) -> str:
        for chat_name, name in _FIELD_NAMES:
            text = text.replace(chat_name, name)
        return _TOOL_FIELD.sub(
            lambda m: f"tools.{translated.tool_indices[int(m[1])]}."
            if int(m[1]) < len(translated.tool_indices) else m[0], text)

    param = error.param
    if param is not None:
        param = "input" if param.startswith("messages") else rename(param)
    return APIError(error.status, rename(error.message), param)

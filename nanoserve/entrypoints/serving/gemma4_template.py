"""Gemma 4's chat templates, and what their messages and prompt need mended (llama.cpp's
`common/parsers/gemma4.cpp` does the same two things).

Gemma 4 writes a call's results inside its own model turn, after the call:
`<|tool_call>call:NAME{...}<tool_call|><|tool_response>response:NAME{...}<tool_response|>`.

- The newer official template (llama.cpp's `models/templates/google-gemma-4-31B-it.jinja`) finds
  them itself: after an assistant message's calls it writes the `role: "tool"` messages that
  follow, naming each by the call its `tool_call_id` answers. The older ones (the first
  release's, the one inside llama.cpp's `ggml-vocab-gemma-4.gguf`, the `-interleaved` variant)
  read only an assistant message's own `tool_responses` and would write the tool messages as
  turns of a `tool` role the model never saw. For a template that reads `tool_responses` and never
  `tool_call_id`, `template_messages` folds each assistant message with calls, the tool messages
  after it and a plain answer right after those into one message, as llama.cpp's
  `convert_tool_responses_gemma4` does: `tool_responses` of `{"name", "response"}` (the name of
  the call the result answers, by id, else by position, else the id; the content as JSON where it
  parses, which the template writes as `key:value` pairs), the answer as its content. The
  assistant's own text beside its calls is left out (llama.cpp's choice: the template would write
  it after the results and close the turn, leaving the model no turn to go on in).
- Either template closes the model's turn after results when the assistant message also had
  content, and then adds no generation prompt: `generation_prompt` opens a model turn there.
"""

from __future__ import annotations

import json
from typing import Any

_CALL_WRITTEN = "<|tool_call>call:"  # what every Gemma 4 template writes for a call
_TURN_CLOSED = "<turn|>\n"
MODEL_TURN = "<|turn>model\n"


def template_text(chat_template: str | None, tokenizer: Any) -> str | None:
    """The template's Jinja source: `--chat-template`'s, else the tokenizer's (of several named
    ones, the default)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None


def is_gemma4_template(template: str | None) -> bool:
    """Whether a chat template's Jinja source writes Gemma 4's tool calls."""
    return template is not None and _CALL_WRITTEN in template


def template_messages(template: str | None,
                      messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as `template` reads tool results: as they are, but for an older Gemma 4
    template, where tool messages are folded into their assistant's `tool_responses`."""
    if not is_gemma4_template(template) or "tool_call_id" in (template or "") \
            or "tool_responses" not in (template or ""):
        return messages
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        if message["role"] != "assistant" or not message.get("tool_calls"):
            out.append(message)
            i += 1
            continue
        folded, i = _model_turn(messages, i)
        out.append(folded)
    return out


def generation_prompt(template: str | None, prompt: str, add_generation_prompt: bool) -> str:
    """`prompt` with a model turn opened where a Gemma 4 template left none after a closed
    turn though one was asked for (llama.cpp PR #21760)."""
    if add_generation_prompt and is_gemma4_template(template) and prompt.endswith(_TURN_CLOSED):
        return prompt + MODEL_TURN
    return prompt


def _model_turn(messages: list[dict[str, Any]], at: int) -> tuple[dict[str, Any], int]:
    """The assistant message at `at` with the tool results and the answer after it, as one
    message; and where the messages go on."""
    message = messages[at]
    calls = message["tool_calls"]
    names = {call.get("id"): call["function"]["name"] for call in calls}
    responses: list[dict[str, Any]] = []
    i = at + 1
    while i < len(messages) and messages[i]["role"] == "tool":
        result = messages[i]
        call_id = result.get("tool_call_id")
        by_place = calls[len(responses)]["function"]["name"] if len(responses) < len(calls) \
            else None
        name = names.get(call_id) or by_place or call_id or ""
        responses.append({"name": name, "response": _response(result.get("content"))})
        i += 1
    folded: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
    if responses:
        folded["tool_responses"] = responses
    if i < len(messages) and messages[i]["role"] == "assistant" \
            and not messages[i].get("tool_calls") and messages[i].get("content"):
        folded["content"] = messages[i]["content"]
        i += 1
    if message.get("reasoning_content"):
        folded["reasoning_content"] = message["reasoning_content"]
    return folded, i


def _response(content: Any) -> Any:
    """A tool message's content as the template writes a response: JSON text parsed, else as
    it is."""
    if isinstance(content, str):
        try:
            return json.loads(content)
        except json.JSONDecodeError:
            return content
    return content

"""gpt-oss's harmony chat template (llama.cpp's `models/templates/openai-gpt-oss-120b.jinja`, the
HF model's own), and what its messages and prompt need mended (llama.cpp's
`common/parsers/gpt-oss.cpp` does the first three; vLLM's `harmony_utils.py` the fourth).

- The template reads an assistant's earlier reasoning from `thinking`, not `reasoning_content`:
  the field is copied over (an Anthropic thinking block and a Responses reasoning item arrive as
  `reasoning_content` too).
- It raises on a call message with both content and thinking: the content is dropped there and
  the thinking kept (llama.cpp's choice; harmony's docs keep the analysis before a call, and
  the template would write that content on the analysis channel anyway).
- It raises on `<|channel|>analysis<|message|>` in content or thinking; any `<|channel|>` in an
  assistant's text is refused first, as a 400 that names the field and says where the text goes.
- It renders one call per assistant message and names each tool result after the latest call:
  an assistant message with several calls becomes one message per call, each followed by the
  tool message that answers it (by `tool_call_id`, else in order), so every result is written
  under its own function's name.
- It writes every tool's `description` unguarded (a tool without one, as Anthropic's clients
  send, fails the render): such a tool gets an empty one.
- With no generation prompt (`continue_final_message`), the last `<|return|>` becomes `<|end|>`
  (llama.cpp #15417): `<|return|>` ends a generation and is never model input.

`reasoning_effort` reaches it as a kwarg (`reasoning_options.py`), as `low`, `medium` or `high`.
"""

from __future__ import annotations

from typing import Any

from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.parsers.harmony import CHANNEL, END, RETURN
from nanoserve.parsers.tool_format import is_harmony_template

# harmony has no "off" and three levels: OpenAI's other efforts go to the nearest one
HARMONY_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium",
                   "high": "high", "xhigh": "high"}


def harmony_messages(template: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the harmony template reads them (see the module); others as they are.
    A 400 naming the field for harmony's format tags in an assistant's text."""
    if not is_harmony_template(template):
        return messages
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        message = dict(messages[i])
        if message["role"] == "assistant":
            _check_text(message, i)
            if message.get("reasoning_content"):
                message["thinking"] = message.pop("reasoning_content")
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or not calls:
            out.append(message)
            i += 1
            continue
        if message.get("thinking"):
            message.pop("content", None)
        results, i = _results(messages, i + 1)
        out.extend(_one_call_each(message, calls, results))
    return out


def harmony_tools(template: str | None,
                  tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as the harmony template reads them: each with a `description` (see the
    module); others as they are."""
    if tools is None or not is_harmony_template(template):
        return tools
    return [{**tool, "function": {**tool["function"], "description": ""}}
            if tool.get("function", {}).get("description") is None else tool for tool in tools]


def harmony_prompt(template: str | None, prompt: str, add_generation_prompt: bool) -> str:
    """The rendered prompt with a trailing `<|return|>` made `<|end|>` where no generation
    prompt follows (see the module)."""
    if add_generation_prompt or not is_harmony_template(template):
        return prompt
    at = prompt.rfind(RETURN)
    return prompt if at == -1 else prompt[:at] + END + prompt[at + len(RETURN):]


def _check_text(message: dict[str, Any], index: int) -> None:
    for key in ("content", "reasoning_content"):
        text = message.get(key)
        if isinstance(text, str) and CHANNEL in text:
            raise bad_request(
                f"messages.{index}.{key} holds harmony's {CHANNEL} tags; send an assistant "
                "turn's analysis as reasoning_content (a thinking block, a reasoning item) and "
                "its final text as content, without the format tokens",
                f"messages.{index}.{key}")


def _results(messages: list[dict[str, Any]], at: int) -> tuple[list[dict[str, Any]], int]:
    """The tool messages from `at` on, and where the messages go on."""
    i = at
    while i < len(messages) and messages[i]["role"] == "tool":
        i += 1
    return messages[at:i], i


def _one_call_each(message: dict[str, Any], calls: list[dict[str, Any]],
                   results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One assistant message per call (the first keeps the text and thinking), each followed
    by its result; results that answer no call follow, in order."""
    if len(calls) == 1:
        return [message, *results]
    call_ids = {call.get("id") for call in calls}
    left = list(results)
    out: list[dict[str, Any]] = []
    for n, call in enumerate(calls):
        turn: dict[str, Any] = dict(message) if n == 0 else {"role": "assistant", "content": ""}
        turn["tool_calls"] = [call]
        out.append(turn)
        result = next((r for r in left if r.get("tool_call_id") == call.get("id")), None) \
            or next((r for r in left if r.get("tool_call_id") not in call_ids), None)
        if result is not None:
            left.remove(result)
            out.append(result)
    return out + left

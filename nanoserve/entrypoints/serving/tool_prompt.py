"""Tools for a chat template that never reads them: described in the system message in the
Hermes form, with earlier calls and tool results written as Hermes writes them, so that the
model sees its tools and the conversation's tool turns (`parsers/tool_format.py` says when).
The wording is ours; the tags are the ones the `hermes` parser reads back."""

from __future__ import annotations

import json
from typing import Any

_TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. The "
    "functions are described within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object of its name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <arguments-json-object>}}\n</tool_call>')


def describe_tools(messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages (as `chat_prompt.message_dicts` makes them) with the tools in the system
    message, each assistant's `tool_calls` as `<tool_call>` blocks in its content, and each
    tool result as a user turn in `<tool_response>` tags."""
    out = [_as_text(message) for message in messages]
    if tools:
        description = _TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{description}"}
        else:
            out.insert(0, {"role": "system", "content": description})
    return out


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = "\n".join(
        "<tool_call>\n" + json.dumps({"name": call["function"]["name"],
                                      "arguments": call["function"]["arguments"]})
        + "\n</tool_call>" for call in calls)
    content = f"{message['content']}\n{blocks}" if message["content"] else blocks
    return {key: value for key, value in message.items() if key != "tool_calls"} | {
        "content": content}

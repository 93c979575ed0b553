"""A finished sample as Anthropic's message parts: its content blocks, its stop reason and
stop sequence, and the usage, shared by the whole message and the stream.

Usage is counted as Anthropic counts it: `input_tokens` are the prompt tokens computed for this
request, `cache_read_input_tokens` those the prefix cache served, so the two add up to the
prompt (what `count_tokens` says). `cache_creation_input_tokens` is always 0: the prefix cache
keeps blocks without being asked, and a write costs nothing more than the input it was.
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.outputs import CompletionOutput
from nanoserve.parsers.chat_stream import ParsedMessage


def content_blocks(parsed: ParsedMessage) -> list[dict[str, Any]]:
    """A whole output's blocks: its reasoning, its text, then its tool calls."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": tool_input(call.arguments)})
    return blocks


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is. Arguments that are no JSON
    object (a call cut off by max_tokens) give {}, as a streamed client's partial parse of
    nothing would; the stop reason then says max_tokens."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(sample: CompletionOutput, has_calls: bool,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a finished sample: `max_tokens` when
    the cap or the context ran out (a cut-off call too), `tool_use` when it calls, named or
    chosen, `stop_sequence` when one of the client's sequences ended it, else `end_turn`."""
    if sample.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(sample.stop_reason, str) and sample.stop_reason in (stop_sequences or ()):
        return "stop_sequence", sample.stop_reason
    return "end_turn", None


def message_usage(num_prompt: int, num_cached: int, num_output: int) -> dict[str, int]:
    """Anthropic's usage (see the module): the prompt split into computed and cache-read."""
    return {"input_tokens": num_prompt - num_cached, "output_tokens": num_output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": num_cached}

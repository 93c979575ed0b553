"""A streamed message as Anthropic's named server-sent events, formatted from the neutral
parser events (`nanoserve/parsers/events.py`).

The order, as Anthropic's API sends it: `message_start` (the message with no content, and the
prompt's usage), `ping`, then each content block as `content_block_start`, its
`content_block_delta`s (`thinking_delta`, `text_delta`, or `input_json_delta` whose
`partial_json` pieces add up to the call's arguments) and `content_block_stop`; then
`message_delta` (stop reason, stop sequence, the final usage) and `message_stop`. Every event is
`event: <type>` then `data: <JSON with the same type>`. `message_start` waits for the engine's
first output, which says how much of the prompt the prefix cache served. An error after the
200 has gone out is one `error` event in Anthropic's error shape, and the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from nanoserve.entrypoints.anthropic.errors import anthropic_error
from nanoserve.entrypoints.anthropic.message_content import message_usage, stop_reason
from nanoserve.entrypoints.serving.engine_errors import SERVING_ERRORS, api_error_of
from nanoserve.outputs import RequestOutput
from nanoserve.parsers.chat_stream import ChatStreamParser
from nanoserve.parsers.events import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)


def sse(body: dict[str, Any]) -> str:
    """One named event; its name is the body's type."""
    return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


class BlockFormatter:
    """Neutral events → content-block events. Text and reasoning each make one block per run
    (a run of text after a call is a new block); each call is its own `tool_use` block."""

    def __init__(self) -> None:
        self.index = -1  # the open block's, or the last one's
        self.open: str | None = None  # the open block's type

    def events(self, chat_events: list[ChatEvent]) -> list[str]:
        out: list[str] = []
        for event in chat_events:
            if isinstance(event, ReasoningDelta):
                self._ensure(out, "thinking", {"thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, TextDelta):
                self._ensure(out, "text", {"text": ""})
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, ToolCallStart):
                self._start(out, "tool_use", {"id": event.id, "name": event.name, "input": {}})
            elif isinstance(event, ToolCallArguments):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": event.delta}))
            elif isinstance(event, ToolCallEnd):
                self.close(out)
        return out

    def close(self, out: list[str]) -> None:
        """End the open block, if any."""
        if self.open is not None:
            out.append(sse({"type": "content_block_stop", "index": self.index}))
            self.open = None

    def _ensure(self, out: list[str], kind: str, fields: dict[str, Any]) -> None:
        if self.open != kind:
            self._start(out, kind, fields)

    def _start(self, out: list[str], kind: str, fields: dict[str, Any]) -> None:
        self.close(out)
        self.index += 1
        self.open = kind
        out.append(sse({"type": "content_block_start", "index": self.index,
                        "content_block": {"type": kind, **fields}}))

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta})


async def message_events(outputs: AsyncIterator[RequestOutput],
                         parser: ChatStreamParser, *, message_id: str, model: str,
                         num_prompt_tokens: int, stop_sequences: list[str] | None
                         ) -> AsyncGenerator[str, None]:
    """The stream's events, from the engine's outputs of one sample (see the module)."""
    blocks = BlockFormatter()
    num_output = num_cached = 0
    has_calls = False
    last = None
    async for out in outputs:
        if last is None:
            num_cached = out.num_cached_tokens
            yield sse({"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": message_usage(num_prompt_tokens, num_cached, 0)}})
            yield sse({"type": "ping"})
        last = out.outputs[0]
        num_output += len(last.token_ids)
        chat_events = parser.feed(last.text, last.finished)
        has_calls = has_calls or any(isinstance(e, ToolCallStart) for e in chat_events)
        for event in blocks.events(chat_events):
            yield event
    assert last is not None  # the engine's last output is the finished one
    closing: list[str] = []
    blocks.close(closing)
    for event in closing:
        yield event
    reason, sequence = stop_reason(last, has_calls, stop_sequences)
    yield sse({"type": "message_delta",
               "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": message_usage(num_prompt_tokens, num_cached, num_output)})
    yield sse({"type": "message_stop"})


async def with_error_events(events: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """The events; an error once the stream has begun (the 200 is sent) becomes one `error`
    event in Anthropic's shape, which the SDKs raise as the matching error."""
    try:
        async for event in events:
            yield event
    except SERVING_ERRORS as e:
        error = api_error_of(e)
        yield sse(anthropic_error(error.status, error.message))
    finally:
        await events.aclose()  # (a client that went away: its request is aborted now)

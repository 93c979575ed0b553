"""A streamed chat or generate answer as Ollama's NDJSON lines, formatted from the neutral
parser events (`nanoserve/parsers/events.py`).

One line per engine output that adds text: `{"model", "created_at", "message": {"role":
"assistant", "content", "thinking"?, "tool_calls"?}, "done": false}` (generate: `"response"`
and `"thinking"` in place of `message`); a tool call goes out whole, in the line of the output
that completes it, as Ollama sends calls. Then the final object: empty text, `done: true`,
`done_reason` and the timings (`replies.py`). An error after the 200 has gone out is one line
`{"error": "<message>"}`, which Ollama's clients raise, and the stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from nanoserve.entrypoints.ollama.errors import ollama_error, ollama_message
from nanoserve.entrypoints.ollama.replies import ReplyShape, ndjson, tool_call
from nanoserve.entrypoints.serving.engine_errors import SERVING_ERRORS, api_error_of
from nanoserve.outputs import RequestOutput
from nanoserve.parsers.chat_stream import ChatStreamParser
from nanoserve.parsers.events import (
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)


async def reply_lines(outputs: AsyncIterator[RequestOutput], parser: ChatStreamParser,
                      shape: ReplyShape, num_prompt: int) -> AsyncGenerator[str, None]:
    """The stream's lines, from the engine's outputs of one sample (see the module)."""
    open_calls: dict[int, list[str]] = {}  # index -> [name, arguments so far]
    num_output = 0
    last = None
    async for out in outputs:
        last = out
        sample = out.outputs[0]
        num_output += len(sample.token_ids)
        content: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for event in parser.feed(sample.text, sample.finished):
            if isinstance(event, TextDelta):
                content.append(event.text)
            elif isinstance(event, ReasoningDelta):
                thinking.append(event.text)
            elif isinstance(event, ToolCallStart):
                open_calls[event.index] = [event.name, ""]
            elif isinstance(event, ToolCallArguments):
                open_calls[event.index][1] += event.delta
            elif isinstance(event, ToolCallEnd):
                calls.append(tool_call(*open_calls.pop(event.index)))
        if content or thinking or calls:
            yield ndjson({**shape.head(), **shape.body("".join(content), "".join(thinking),
                                                        calls), "done": False})
    assert last is not None  # the engine's last output is the finished one
    yield ndjson({**shape.head(), **shape.body(""),
                  **shape.final(last.outputs[0].finish_reason, last.metrics, num_prompt,
                                num_output)})


async def with_error_lines(lines: AsyncGenerator[str, None]) -> AsyncIterator[str]:
    """The lines; an error once the stream has begun (the 200 is sent) becomes one error line
    in Ollama's shape."""
    try:
        async for line in lines:
            yield line
    except SERVING_ERRORS as e:
        error = api_error_of(e)
        yield ndjson(ollama_error(ollama_message(error.message, error.param)))
    finally:
        await lines.aclose()  # (a client that went away: its request is aborted now)

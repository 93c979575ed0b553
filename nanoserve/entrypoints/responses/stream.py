"""A streamed response: the Responses API's named events, each numbered by `sequence_number`.

`response.created` and `response.in_progress` (the response with no output yet), then the
output items' events as the parsers find them (`items.py`: `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` / `.done`,
`response.function_call_arguments.delta` / `.done`, `response.output_item.done`, ...), then
`response.completed`, `response.incomplete` or `response.failed` with the whole response.
Each event is framed as OpenAI frames them, `event: <type>` then `data: <json>`, with no
`[DONE]` at the end. An error after the 200 is an `error` event (also carrying OpenAI's error
object, which the `openai` SDK raises) followed by `response.failed` (which Codex reads).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import cast

from nanoserve.entrypoints.responses.items import Event, OutputItems
from nanoserve.entrypoints.responses.response import (
    Outcome,
    ResponseFrame,
    outcome,
    response_usage,
)
from nanoserve.entrypoints.serving.engine_errors import SERVING_ERRORS, api_error_of
from nanoserve.entrypoints.serving.errors import APIError
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.outputs import RequestOutput
from nanoserve.parsers.chat_stream import ChatStreamParser
from nanoserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ResponseRun:
    """One response's request to the engine, and the parser of its output."""

    frame: ResponseFrame
    prompt: str
    ids: list[int]
    params: SamplingParams
    parser: ChatStreamParser

    def num_reasoning_tokens(self, ctx: ServerContext, items: OutputItems,
                             token_ids: list[int]) -> int:
        """The output tokens of the reasoning section: those before its `</think>`, less an
        opening `<think>`; re-encoded from its text on a model whose tags are not tokens."""
        text = items.reasoning_text
        if not text:
            return 0
        tags = ctx.reasoning_tokens
        if tags is None:
            return len(ctx.tokenizer.encode(text, add_special_tokens=False))
        section = token_ids[: token_ids.index(tags.end)] if tags.end in token_ids \
            else token_ids
        return len(section) - (1 if section[:1] == [tags.start] else 0)


Framer = Callable[[Event], str]


def _framed(numbers: Iterator[int]) -> Framer:
    """Frames each event as `event:` and `data:` lines, numbering them in order."""
    def frame(event: Event) -> str:
        body = {"type": event["type"], "sequence_number": next(numbers), **event}
        return f"event: {event['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
    return frame


async def stream_response(ctx: ServerContext, run: ResponseRun) -> AsyncIterator[str]:
    """The events of one streamed response (see the module)."""
    frame = _framed(itertools.count())
    body = run.frame.body
    yield frame({"type": "response.created", "response": body("in_progress")})
    yield frame({"type": "response.in_progress", "response": body("in_progress")})
    items = OutputItems()
    num_cached = 0
    token_ids: list[int] = []
    finish_reason = None
    # (an async generator function, typed by what it yields)
    generator = cast(AsyncGenerator[RequestOutput, None], ctx.engine.generate(
        run.frame.id, run.prompt, run.ids, run.params))
    try:
        async for out in generator:
            num_cached = max(num_cached, out.num_cached_tokens)
            sample = out.outputs[0]
            token_ids += sample.token_ids
            for event in items.feed(run.parser.feed(sample.text, sample.finished)):
                yield frame(event)
            finish_reason = sample.finish_reason
    except SERVING_ERRORS as e:
        for text in _failed(frame, run.frame, items, api_error_of(e)):
            yield text
        return
    finally:
        await generator.aclose()  # (a client that went away: its request is aborted now)
    ended = outcome(finish_reason)
    for event in items.finish("incomplete" if ended.status == "incomplete" else "completed"):
        yield frame(event)
    usage = response_usage(len(run.ids), len(token_ids), num_cached,
                           run.num_reasoning_tokens(ctx, items, token_ids))
    yield frame({"type": f"response.{ended.status}",
                 "response": body(ended.status, items, usage, ended)})


def _failed(frame: Framer, response: ResponseFrame, items: OutputItems,
            error: APIError) -> list[str]:
    """An error after the 200: an `error` event, then `response.failed`."""
    info = error.body()["error"]
    ended = Outcome("failed", error={"code": str(info["type"]), "message": error.message})
    return [frame({"type": "error", "code": str(info["type"]), "message": error.message,
                   "param": error.param, "error": info}),
            frame({"type": "response.failed",
                   "response": response.body("failed", items, None, ended)})]

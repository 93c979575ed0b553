"""POST /v1/responses: the body translated into the neutral chat input (`request.py`), through
the chat endpoint's checks, template and params (`serving_chat.prepare_chat`); one sample,
parsed into neutral events (reasoning, text, tool calls) and formatted as output items
(`items.py`), streamed (`stream.py`) or at once."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.entrypoints.responses.items import OutputItems
from nanoserve.entrypoints.responses.protocol import ResponsesRequest
from nanoserve.entrypoints.responses.request import renamed, responses_input
from nanoserve.entrypoints.responses.response import (
    ResponseFrame,
    outcome,
    response_usage,
)
from nanoserve.entrypoints.responses.stream import ResponseRun, stream_response
from nanoserve.entrypoints.serving.chat_choice import choice_parsers
from nanoserve.entrypoints.serving.disconnect import collect, until_disconnect
from nanoserve.entrypoints.serving.errors import APIError
from nanoserve.entrypoints.serving.prepare import prepare_chat
from nanoserve.entrypoints.serving.server_context import ServerContext


async def create_response(ctx: ServerContext, req: ResponsesRequest, raw: Request) -> Response:
    """The response to `req`, whole or as an event stream."""
    ctx.check_model(req.model)
    translated = responses_input(req)
    chat = translated.chat
    try:
        prompt, ids, params, plan = await prepare_chat(ctx, chat)
    except APIError as e:
        raise renamed(e, translated) from None
    parser = choice_parsers(chat, prompt, plan, ctx.reasoning_parser,
                            ctx.tool_call_parser)[0].parser
    frame = ResponseFrame.of(ctx.model_name, req, params)
    run = ResponseRun(frame, prompt, ids, params, parser)
    if chat.sampling.stream:
        return StreamingResponse(stream_response(ctx, run), media_type="text/event-stream")
    out = await until_disconnect(raw, collect(ctx.engine.generate(frame.id, prompt, ids,
                                                                 params)))
    sample = out.outputs[0]
    items = OutputItems()
    items.feed(parser.feed(sample.text, is_final=True))
    ended = outcome(sample.finish_reason)
    items.finish("incomplete" if ended.status == "incomplete" else "completed")
    usage = response_usage(len(ids), len(sample.token_ids), out.num_cached_tokens,
                           run.num_reasoning_tokens(ctx, items, sample.token_ids))
    return JSONResponse(frame.body(ended.status, items, usage, ended))

"""POST /v1/messages and /v1/messages/count_tokens: the body translated into the neutral chat
input (`messages_request.py`), prepared as chat completions prepares it (tools, grammar,
template, sampling params), one sample parsed into the neutral events and formatted as
Anthropic's content blocks, whole or streamed (`messages_stream.py`).

`max_tokens` is a cap, not a demand: Anthropic requires it and Claude Code asks for 32,000
whatever the model, which on an 8k-context model is more than the context holds. Chat
completions answers that with a 400 (vLLM's rule, `token_limits.py`); a Claude Code user would
then get nothing at all. Here the output is held to what the context leaves after the prompt
(`max_tokens_is_cap`, the one policy in serving/token_limits.py), and if it fills that,
`stop_reason` says `max_tokens`, as it does when the cap is reached. A prompt that leaves no
room is still a 400.
"""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.entrypoints.anthropic.message_content import (
    content_blocks,
    message_usage,
    stop_reason,
)
from nanoserve.entrypoints.anthropic.messages_request import messages_input
from nanoserve.entrypoints.anthropic.messages_stream import message_events, with_error_events
from nanoserve.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from nanoserve.entrypoints.serving.chat_choice import choice_parsers
from nanoserve.entrypoints.serving.disconnect import collect, until_disconnect
from nanoserve.entrypoints.serving.prepare import chat_prompt_ids, prepare_chat
from nanoserve.entrypoints.serving.server_context import ServerContext


async def create_message(ctx: ServerContext, req: MessagesRequest, raw: Request, *,
                         strip_billing: bool = True) -> Response:
    ctx.check_model(req.model)
    chat = messages_input(req, strip_billing=strip_billing,
                          has_reasoning_tokens=ctx.has_reasoning_tokens)
    prompt, ids, params, plan = await prepare_chat(ctx, chat)
    parser = choice_parsers(chat, prompt, plan, ctx.reasoning_parser,
                            ctx.tool_call_parser)[0].parser
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    outputs = ctx.engine.generate(message_id, prompt, ids, params)
    if req.stream:
        events = message_events(outputs, parser, message_id=message_id, model=ctx.model_name,
                                num_prompt_tokens=len(ids), stop_sequences=req.stop_sequences)
        return StreamingResponse(with_error_events(events), media_type="text/event-stream")
    out = await until_disconnect(raw, collect(outputs))
    sample = out.outputs[0]
    parsed = parser.parse(sample.text)
    reason, sequence = stop_reason(sample, bool(parsed.tool_calls), req.stop_sequences)
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": ctx.model_name,
        "content": content_blocks(parsed), "stop_reason": reason, "stop_sequence": sequence,
        "usage": message_usage(len(ids), out.num_cached_tokens, len(sample.token_ids))})


async def count_tokens(ctx: ServerContext, req: CountTokensRequest, *,
                       strip_billing: bool = True) -> dict[str, int]:
    """The prompt `create` would prefill for this body, counted (tools and template alike)."""
    ctx.check_model(req.model)
    chat = messages_input(req, strip_billing=strip_billing,
                          has_reasoning_tokens=ctx.has_reasoning_tokens)
    _, ids = await chat_prompt_ids(ctx, chat)  # (an image's placeholders counted)
    return {"input_tokens": len(ids)}

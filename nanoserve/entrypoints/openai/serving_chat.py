"""POST /v1/chat/completions: the body translated into the neutral chat input
(`chat_request.py`), which goes through the chat template (`chat_prompt.py`) with its tools
(`tool_plan.py`); n samples, each parsed into neutral events (reasoning, content, tool calls)
and formatted as OpenAI's message or deltas (`chat_choice.py`), streamed or at once."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.entrypoints.openai.chat_request import chat_input
from nanoserve.entrypoints.openai.progress import progress_json
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest
from nanoserve.entrypoints.openai.sse import sse_event, sse_with_errors
from nanoserve.entrypoints.openai.usage import usage
from nanoserve.entrypoints.serving.chat_choice import ChoiceParser, choice_parsers
from nanoserve.entrypoints.serving.chat_input import ChatInput
from nanoserve.entrypoints.serving.disconnect import collect, until_disconnect
from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.logprob_format import clamp_logprob, token_bytes, top_entries
from nanoserve.entrypoints.serving.prepare import prepare_chat
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.entrypoints.serving.tool_plan import ToolPlan
from nanoserve.outputs import PositionLogprobs
from nanoserve.protocol import PromptProgress
from nanoserve.sampling_params import SamplingParams


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("when using top_logprobs, logprobs must be set to true",
                          "top_logprobs")


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest,
                                 raw: Request) -> Response:
    ctx.check_model(req.model)
    _check_unsupported(req)
    chat = chat_input(req)
    prompt, ids, params, plan = await prepare_chat(ctx, chat)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    parsers = choice_parsers(chat, prompt, plan, ctx.reasoning_parser, ctx.tool_call_parser)
    if chat.sampling.stream:
        return StreamingResponse(sse_with_errors(_stream(ctx, chat, request_id, created, prompt,
                                                         ids, params, parsers, plan)),
                                 media_type="text/event-stream")
    out = await until_disconnect(raw, collect(ctx.engine.generate(request_id, prompt, ids,
                                                                 params)))
    num_top = chat.sampling.logprobs
    choices = []
    for sample in out.outputs:
        parser = parsers[sample.index]
        message = {"role": "assistant", **parser.message(sample.text)}
        choices.append({"index": sample.index, "message": message,
                        "logprobs": _chat_logprobs(ctx, sample.token_ids, sample.logprobs,
                                                   num_top)
                        if num_top is not None else None,
                        "finish_reason": plan.finish_reason(parser.has_calls,
                                                            sample.finish_reason),
                        "stop_reason": sample.stop_reason})
    num_output = sum(len(s.token_ids) for s in out.outputs)
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": created,
                         "model": ctx.model_name, "choices": choices,
                         "usage": usage(len(ids), num_output, out.num_cached_tokens)})


async def render_chat(ctx: ServerContext, req: ChatCompletionRequest) -> list[int]:
    """The ids /v1/chat/completions would prefill for `req`, after its checks (less the
    in-flight cap: a render admits nothing)."""
    ctx.check_model(req.model)
    _check_unsupported(req)
    _, ids, _, _ = await prepare_chat(ctx, chat_input(req), admit=False)
    return ids


def _chat_logprobs(ctx: ServerContext, token_ids: list[int],
                   positions: list[PositionLogprobs] | None,
                   num_top: int) -> dict[str, Any] | None:
    if positions is None:
        return None
    text_of = ctx.engine.processor.logprobs.token_text
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        text = text_of(token_id)
        content.append({
            "token": text, "logprob": clamp_logprob(position[token_id].logprob),
            "bytes": token_bytes(text),
            "top_logprobs": [{"token": text_of(t), "logprob": clamp_logprob(lp.logprob),
                              "bytes": token_bytes(text_of(t))}
                             for t, lp in top_entries(position, num_top)]})
    return {"content": content}


async def _stream(ctx: ServerContext, chat: ChatInput, request_id: str,
                  created: int, prompt: str, ids: list[int], params: SamplingParams,
                  parsers: list[ChoiceParser], plan: ToolPlan) -> AsyncGenerator[str, None]:
    options = chat.sampling.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    num_top = chat.sampling.logprobs
    num_output = num_cached = 0

    def event(choices: list[dict[str, Any]], with_usage: bool = False,
              progress: PromptProgress | None = None) -> str:
        body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk",
                                "created": created, "model": ctx.model_name,
                                "choices": choices}
        if with_usage or continuous:
            body["usage"] = usage(len(ids), num_output, num_cached)
        if progress is not None:
            body["prompt_progress"] = progress_json(progress)
        return sse_event(body)

    for i in range(chat.sampling.n):  # the role comes first, once per choice
        yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
    async for out in ctx.engine.generate(request_id, prompt, ids, params):
        num_cached = max(num_cached, out.num_cached_tokens)
        if out.prompt_progress is not None:  # a chunk of its own, as llama-server's delta
            yield event([{"index": 0, "delta": {"role": "assistant", "content": None},
                          "logprobs": None, "finish_reason": None}],
                        progress=out.prompt_progress)
        for sample in out.outputs:
            num_output += len(sample.token_ids)
            parser = parsers[sample.index]
            # one chunk per delta: a call's first delta (id, name) goes alone, as OpenAI's do
            deltas = parser.deltas(sample.text, sample.finished)
            logprobs = _chat_logprobs(ctx, sample.token_ids, sample.logprobs,
                                      num_top) if num_top is not None else None
            if not deltas and (sample.finished or (logprobs and logprobs["content"])):
                deltas = [{}]
            for k, delta in enumerate(deltas):
                is_last = k == len(deltas) - 1
                finish_reason = plan.finish_reason(parser.has_calls, sample.finish_reason) \
                    if is_last else None
                yield event([{"index": sample.index, "delta": delta,
                              "logprobs": logprobs if k == 0 else None,
                              "finish_reason": finish_reason,
                              "stop_reason": sample.stop_reason if is_last else None}])
    if include_usage:
        yield event([], with_usage=True)

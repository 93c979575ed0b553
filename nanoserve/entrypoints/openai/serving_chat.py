"""POST /v1/chat/completions: messages (and tools) through the chat template, n samples,
optional reasoning split (`reasoning` and `reasoning_content`) and tool calls
(`serving_tools.py`), streamed or at once."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.entrypoints.openai.errors import bad_request
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from nanoserve.entrypoints.openai.serving_common import (
    ServerContext,
    clamp_logprob,
    collect,
    resolve_max_tokens,
    sampling_params,
    sse_with_errors,
    token_bytes,
    top_entries,
    until_disconnect,
    usage,
)
from nanoserve.entrypoints.openai.serving_tools import (
    ChoiceParser,
    ToolPlan,
    plan_tools,
    template_tools,
    tool_call_parser_for,
    tool_message_fields,
)
from nanoserve.entrypoints.openai.structured_outputs import structured_outputs
from nanoserve.parsers.reasoning import make_reasoning_parser, prompt_ends_in_reasoning
from nanoserve.outputs import PositionLogprobs
from nanoserve.sampling_params import RequestOutputKind


def _message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content part type {part.type!r} is not supported; this "
                                      "model reads text only", f"messages.{i}.content")
                texts.append(part.text)
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        entry.update(tool_message_fields(message, i))
        out.append(entry)
    return out


def render_prompt(ctx: ServerContext, req: ChatCompletionRequest) -> str:
    """The chat template applied to the messages, with the request's template switches."""
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be "
                          "true", "continue_final_message")
    kwargs = dict(req.chat_template_kwargs or {})
    if "chat_template" in kwargs:  # request-supplied templates run arbitrary Jinja
        raise bad_request("chat_template_kwargs may not replace the chat template",
                          "chat_template_kwargs")
    messages = _message_dicts(req.messages)
    if req.continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs a final assistant message",
                          "continue_final_message")
    if req.tools is not None:
        kwargs["tools"] = template_tools(req.tools)
    if ctx.chat_template is not None:
        kwargs["chat_template"] = ctx.chat_template
    try:
        return str(ctx.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, **kwargs))
    except Exception as e:  # jinja errors, raise_exception() in templates
        raise bad_request(f"the chat template could not render these messages: {e}",
                          "messages") from None


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("when using top_logprobs, logprobs must be set to true",
                          "top_logprobs")


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest,
                                 raw: Request) -> Response:
    ctx.check_model(req.model)
    _check_unsupported(req)
    plan = plan_tools(req, ctx.tool_call_parser)
    structured = await structured_outputs(req, has_tool_grammar=plan.structured is not None,
                                          tokenizer=ctx.grammar_tokenizer)
    ctx.check_capacity(n=req.n)
    prompt = render_prompt(ctx, req)
    ids = ctx.tokenizer.encode(prompt, add_special_tokens=False)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    max_tokens = resolve_max_tokens(ctx, len(ids), asked)
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    params = sampling_params(ctx, req, max_tokens=max_tokens,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             output_kind=kind)
    params.structured_outputs = structured
    if plan.structured is not None:
        params.structured_outputs = plan.structured
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    parsers = _parsers(ctx, req, prompt, plan)
    if req.stream:
        return StreamingResponse(sse_with_errors(_stream(ctx, req, request_id, created, prompt,
                                                         ids, params, parsers, plan)),
                                 media_type="text/event-stream")
    out = await until_disconnect(raw, collect(ctx.engine.generate(request_id, prompt, ids,
                                                                 params)))
    choices = []
    for sample in out.outputs:
        parser = parsers[sample.index]
        message = {"role": "assistant", **parser.message(sample.text)}
        choices.append({"index": sample.index, "message": message,
                        "logprobs": _chat_logprobs(ctx, sample.token_ids, sample.logprobs,
                                                   req.top_logprobs or 0)
                        if req.logprobs else None,
                        "finish_reason": plan.finish_reason(parser.has_calls,
                                                            sample.finish_reason),
                        "stop_reason": sample.stop_reason})
    num_output = sum(len(s.token_ids) for s in out.outputs)
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": created,
                         "model": ctx.model_name, "choices": choices,
                         "usage": usage(len(ids), num_output)})


def _parsers(ctx: ServerContext, req: ChatCompletionRequest, prompt: str,
             plan: ToolPlan) -> list[ChoiceParser]:
    """One per sample. Grammar-forced tool output (required / named) has no reasoning."""
    is_reasoning_split = (ctx.reasoning_parser is not None and req.include_reasoning
                          and plan.structured is None)
    inside = is_reasoning_split and prompt_ends_in_reasoning(prompt)
    return [ChoiceParser(make_reasoning_parser(ctx.reasoning_parser, inside)
                         if is_reasoning_split and ctx.reasoning_parser else None,
                         tool_call_parser_for(plan, ctx.tool_call_parser), plan.is_parallel_allowed)
            for _ in range(req.n)]


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


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, request_id: str,
                  created: int, prompt: str, ids: list[int], params: Any,
                  parsers: list[ChoiceParser], plan: ToolPlan) -> AsyncGenerator[str, None]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options and
                                        req.stream_options.continuous_usage_stats)
    num_output = 0

    def event(choices: list[dict[str, Any]], with_usage: bool = False) -> str:
        body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk",
                                "created": created, "model": ctx.model_name,
                                "choices": choices}
        if with_usage or continuous:
            body["usage"] = usage(len(ids), num_output)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    for i in range(req.n):  # the role comes first, once per choice
        yield event([{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
    async for out in ctx.engine.generate(request_id, prompt, ids, params):
        for sample in out.outputs:
            num_output += len(sample.token_ids)
            parser = parsers[sample.index]
            # one chunk per delta: a call's first delta (id, name) goes alone, as OpenAI's do
            deltas = parser.deltas(sample.text, sample.finished)
            logprobs = _chat_logprobs(ctx, sample.token_ids, sample.logprobs,
                                      req.top_logprobs or 0) if req.logprobs else None
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

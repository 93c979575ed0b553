"""POST /v1/completions: one or more prompts (text or token ids), n samples each, streamed as
server-sent events or answered at once."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.entrypoints.openai.progress import progress_json
from nanoserve.entrypoints.openai.protocol import CompletionRequest
from nanoserve.entrypoints.openai.request_fields import sampling_input
from nanoserve.entrypoints.openai.sse import sse_event, sse_with_errors
from nanoserve.entrypoints.openai.usage import usage
from nanoserve.entrypoints.serving.disconnect import collect, until_disconnect
from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.infill_prompt import (
    bos_added,
    file_level_ids,
    fim_refusal,
    plain_tokenizer,
)
from nanoserve.entrypoints.serving.logprob_format import clamp_logprob, top_entries
from nanoserve.entrypoints.serving.request_params import sampling_params
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.entrypoints.serving.structured_outputs import structured_outputs
from nanoserve.entrypoints.serving.token_limits import check_prompt_ids, resolve_max_tokens
from nanoserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from nanoserve.protocol import PromptProgress
from nanoserve.sampling_params import RequestOutputKind, SamplingParams


def _batch(prompt: Any) -> list[Any]:
    """The prompts of a request: one text or id list, or a batch of them."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt must not be empty", "prompt")
    return prompts


def _prompts(ctx: ServerContext, prompts: list[Any]) -> list[tuple[str | None, list[int]]]:
    out: list[tuple[str | None, list[int]]] = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be empty", "prompt")
            out.append((p, ctx.tokenizer.encode(p)))
        else:
            ids = list(p)
            check_prompt_ids(ctx, ids)
            out.append((None, ids))
    return out


def _infill_prompts(ctx: ServerContext, prompts: list[Any],
                    suffix: str) -> list[tuple[str | None, list[int]]]:
    """Each prompt as the prefix of a fill-in-the-middle prompt before `suffix`."""
    plain = plain_tokenizer(ctx.tokenizer)
    suffix_ids = plain(suffix)
    bos = bos_added(ctx.tokenizer)
    out: list[tuple[str | None, list[int]]] = []
    for text, ids in _prompts(ctx, prompts):
        prefix = ids if text is None else plain(text)
        out.append((text, file_level_ids(ctx.fim_tokens, prefix, suffix_ids, bos)))
    return out


async def create_completion(ctx: ServerContext, req: CompletionRequest,
                            raw: Request) -> Response:
    jobs = await prepare_completion(ctx, req)
    echo_only = req.echo and req.max_tokens == 0
    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if req.stream:
        return StreamingResponse(
            sse_with_errors(_stream(ctx, req, request_id, created, jobs, echo_only)),
            media_type="text/event-stream")
    outputs = await until_disconnect(raw, asyncio.gather(*(
        collect(ctx.engine.generate(f"{request_id}-{i}", text, ids, params))
        for i, (text, ids, params) in enumerate(jobs))))
    choices: list[dict[str, Any]] = []
    for (text, _, _), out in zip(jobs, outputs, strict=True):
        for sample in out.outputs:
            choices.append(_choice(ctx, len(choices), req, text, out, sample, echo_only))
    num_prompt = sum(len(ids) for _, ids, _ in jobs)
    num_output = sum(len(s.token_ids) for out in outputs for s in out.outputs)
    num_cached = sum(out.num_cached_tokens for out in outputs)
    return JSONResponse({"id": request_id, "object": "text_completion", "created": created,
                         "model": ctx.model_name, "choices": choices,
                         "usage": usage(num_prompt, 0 if echo_only else num_output,
                                        num_cached)})


async def render_completion(ctx: ServerContext, req: CompletionRequest) -> list[list[int]]:
    """The ids /v1/completions would prefill for each prompt of `req`, after its checks (less
    the in-flight cap: a render admits nothing)."""
    return [ids for _, ids, _ in await prepare_completion(ctx, req, admit=False)]


async def prepare_completion(ctx: ServerContext, req: CompletionRequest, admit: bool = True
                             ) -> list[tuple[str, list[int], SamplingParams]]:
    """The checks, in the order their errors take, then each prompt's text, ids and params;
    `admit=False` (a render) skips the checks of what is in flight (429, 503)."""
    ctx.check_model(req.model)
    if req.suffix is not None and (refusal := fim_refusal(ctx.fim_tokens, ctx.model_name)):
        raise bad_request(f"suffix needs a fill-in-the-middle prompt: {refusal}", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (use n)", "best_of")
    structured = await structured_outputs(req, tokenizer=ctx.grammar_tokenizer)
    batch = _batch(req.prompt)
    # before tokenizing: a batch can hold a million prompts
    if admit:
        ctx.check_capacity(len(batch), req.n)
    else:
        ctx.check_request_size(len(batch), req.n)
    prompts = _prompts(ctx, batch) if req.suffix is None else _infill_prompts(ctx, batch,
                                                                              req.suffix)
    echo_only = req.echo and req.max_tokens == 0
    kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    fields = replace(sampling_input(req, max_tokens=req.max_tokens, logprobs=req.logprobs),
                     echo_logprobs=req.logprobs if req.echo else None)
    jobs = []
    for text, ids in prompts:
        max_tokens = resolve_max_tokens(ctx, len(ids), 1 if echo_only else fields.max_tokens)
        params = sampling_params(ctx, fields, max_tokens=max_tokens, output_kind=kind,
                                 structured=structured)
        shown = text if text is not None else ctx.tokenizer.decode(ids)
        jobs.append((shown, ids, params))
    return jobs


def _choice(ctx: ServerContext, index: int, req: CompletionRequest, prompt_text: str,
            out: RequestOutput, sample: CompletionOutput, echo_only: bool) -> dict[str, Any]:
    text = "" if echo_only else sample.text
    logprobs = None
    if req.logprobs is not None:
        positions: list[PositionLogprobs | None] = []
        token_ids: list[int] = []
        start_text = ""
        if req.echo:
            positions += out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            token_ids += out.prompt_token_ids
        if not echo_only:
            positions += sample.logprobs or []
            token_ids += sample.token_ids
        logprobs = completion_logprobs(ctx, token_ids, positions, req.logprobs, start_text)
    return {"index": index, "text": (prompt_text if req.echo else "") + text,
            "logprobs": logprobs, "finish_reason": "length" if echo_only
            else sample.finish_reason, "stop_reason": None if echo_only else sample.stop_reason}


def completion_logprobs(ctx: ServerContext, token_ids: list[int],
                        positions: list[PositionLogprobs | None], num_top: int,
                        start_text: str = "", start_offset: int = 0) -> dict[str, Any]:
    """The completions-API logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = start_offset + len(start_text)
    for token_id, position in zip(token_ids, positions, strict=True):
        text = ctx.engine.processor.logprobs.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if position is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(clamp_logprob(position[token_id].logprob))
        top = {ctx.engine.processor.logprobs.token_text(t): clamp_logprob(lp.logprob)
               for t, lp in top_entries(position, num_top)}
        top.setdefault(text, clamp_logprob(position[token_id].logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


async def _merged(ctx: ServerContext, request_id: str,
                  jobs: list[tuple[str, list[int], SamplingParams]]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every prompt's updates, interleaved as they come."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, text: str, ids: list[int], params: SamplingParams) -> None:
        try:
            async for out in ctx.engine.generate(f"{request_id}-{i}", text, ids, params):
                queue.put_nowait((i, out))
            queue.put_nowait(None)
        except BaseException as e:
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(i, *job)) for i, job in enumerate(jobs)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:  # a disconnect ends this generator: cancel (and abort) the rest
            task.cancel()


async def _stream(ctx: ServerContext, req: CompletionRequest, request_id: str, created: int,
                  jobs: list[tuple[str, list[int], SamplingParams]],
                  echo_only: bool) -> AsyncGenerator[str, None]:
    n = req.n
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options and
                                        req.stream_options.continuous_usage_stats)
    num_prompt = sum(len(ids) for _, ids, _ in jobs)
    sent_text = [0] * (len(jobs) * n)
    num_output = 0
    cached = [0] * len(jobs)  # each prompt's tokens served by the prefix cache

    def event(choice: dict[str, Any], progress: PromptProgress | None = None) -> str:
        body = {"id": request_id, "object": "text_completion", "created": created,
                "model": ctx.model_name, "choices": [choice]}
        if continuous:
            body["usage"] = usage(num_prompt, num_output, sum(cached))
        if progress is not None:
            body["prompt_progress"] = progress_json(progress)
        return sse_event(body)

    if req.echo:
        for i, (text, _, _) in enumerate(jobs):
            for j in range(n):
                yield event({"index": i * n + j, "text": text, "logprobs": None,
                             "finish_reason": None})
    async for i, out in _merged(ctx, request_id, jobs):
        cached[i] = max(cached[i], out.num_cached_tokens)
        if out.prompt_progress is not None:  # a chunk of its own, before any text (llama's)
            yield event({"index": i * n, "text": "", "logprobs": None, "finish_reason": None},
                        out.prompt_progress)
        for sample in out.outputs:
            index = i * n + sample.index
            num_output += len(sample.token_ids)
            text = "" if echo_only else sample.text
            logprobs = None
            if req.logprobs is not None and sample.logprobs and not echo_only:
                logprobs = completion_logprobs(ctx, sample.token_ids, list(sample.logprobs),
                                               req.logprobs, start_offset=sent_text[index])
            sent_text[index] += len(text)
            if not text and not sample.finished and logprobs is None:
                continue
            yield event({"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": sample.finish_reason,
                         "stop_reason": sample.stop_reason})
    if include_usage:
        body = {"id": request_id, "object": "text_completion", "created": created,
                "model": ctx.model_name, "choices": [],
                "usage": usage(num_prompt, 0 if echo_only else num_output, sum(cached))}
        yield sse_event(body, ensure_ascii=True)  # (escaped, as this event always was)

"""POST /api/chat and /api/generate: the body translated into the neutral chat input
(`chat_request.py`), prepared as chat completions prepares it (tools, grammar, template,
sampling params, the capacity check), the output held to `num_predict` and `num_ctx`
(`output_caps.py`), one sample parsed into the neutral events and formatted as Ollama's reply,
whole or as NDJSON lines (`stream.py`; `stream` defaults to true, as Ollama's does).

On a model without a chat template (a base model), generate completes the prompt as it is,
`system` and a blank line before it, as Ollama's default template (`{{ .Prompt }}`) does;
chat answers a 400 that says how to give the model a template.

A body with nothing to generate (no messages; no prompt) only "loads" the model, as Ollama
answers it: one object, `done_reason` "load", or "unload" with `keep_alive` 0. The model is
loaded while the server runs, so neither changes anything (`keep_alive.py`).

Model names: those every route answers to (`model_names.py`: the served name, the model
file's name and stem, each also with Ollama's default tag `:latest`); another is Ollama's 404,
`model "x" not found, try pulling it first`.
"""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.entrypoints.ollama.chat_request import chat_input, generate_input
from nanoserve.entrypoints.ollama.keep_alive import parse_keep_alive
from nanoserve.entrypoints.ollama.output_caps import check_caps
from nanoserve.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaGenerateRequest,
)
from nanoserve.entrypoints.ollama.replies import ReplyShape, tool_call
from nanoserve.entrypoints.ollama.sampling_options import check_sampling_options
from nanoserve.entrypoints.ollama.stream import reply_lines, with_error_lines
from nanoserve.entrypoints.serving.chat_choice import choice_parsers
from nanoserve.entrypoints.serving.chat_input import ChatInput
from nanoserve.entrypoints.serving.disconnect import collect, until_disconnect
from nanoserve.entrypoints.serving.errors import APIError, bad_request
from nanoserve.entrypoints.serving.infill_prompt import (
    bos_added,
    file_level_ids,
    fim_refusal,
    plain_tokenizer,
)
from nanoserve.entrypoints.serving.prepare import prepare_chat
from nanoserve.entrypoints.serving.server_context import ServerContext

NDJSON = "application/x-ndjson"


def check_model(ctx: ServerContext, model: str | None) -> None:
    """400 without a model, 404 for another model's name (see the module)."""
    if not model:
        raise bad_request("model is required", "model")
    if not ctx.answers_to(model):
        raise APIError(404, f'model "{model}" not found, try pulling it first (this server '
                            f'serves one model, "{ctx.model_name}")', "model")


async def create_chat(ctx: ServerContext, req: OllamaChatRequest, raw: Request) -> Response:
    shape = ReplyShape(req.model or "", is_chat=True, started=time.monotonic())
    check_model(ctx, req.model)
    keep_alive = parse_keep_alive(req.keep_alive)
    check_caps(req.options)
    check_sampling_options(req.options)
    if not req.messages:
        return JSONResponse(shape.empty("unload" if keep_alive == 0 else "load"))
    chat = chat_input(req, ctx.model_name, can_think=ctx.reasoning_parser is not None)
    return await _reply(ctx, raw, chat, shape)


async def create_generate(ctx: ServerContext, req: OllamaGenerateRequest,
                          raw: Request) -> Response:
    shape = ReplyShape(req.model or "", is_chat=False, started=time.monotonic())
    check_model(ctx, req.model)
    keep_alive = parse_keep_alive(req.keep_alive)
    check_caps(req.options)
    check_sampling_options(req.options)
    chat = generate_input(req, ctx.model_name, can_think=ctx.reasoning_parser is not None)
    if not req.prompt:
        return JSONResponse(shape.empty("unload" if keep_alive == 0 else "load"))
    if req.suffix:  # the code models' template: `<PRE>{prompt}<SUF>{suffix}<MID>`
        return await _reply(ctx, raw, chat, shape, prompt_ids=_insert_ids(ctx, req))
    raw_prompt = req.prompt if req.raw else None
    if raw_prompt is None and not ctx.has_chat_template:  # Ollama's template, `{{ .Prompt }}`
        raw_prompt = f"{req.system}\n\n{req.prompt}" if req.system else req.prompt
    return await _reply(ctx, raw, chat, shape, raw_prompt=raw_prompt)


def _insert_ids(ctx: ServerContext, req: OllamaGenerateRequest) -> list[int]:
    """The fill-in-the-middle prompt of a generate with a suffix (its system unused, as the
    code models' templates leave it out)."""
    refusal = fim_refusal(ctx.fim_tokens, f'"{req.model}"')
    if refusal is not None:  # Ollama's words, then why
        raise bad_request(f'"{req.model}" does not support insert: {refusal}', "suffix")
    plain = plain_tokenizer(ctx.tokenizer)
    return file_level_ids(ctx.fim_tokens, plain(req.prompt or ""), plain(req.suffix or ""),
                          bos_added(ctx.tokenizer))


async def _reply(ctx: ServerContext, raw: Request, chat: ChatInput, shape: ReplyShape,
                 raw_prompt: str | None = None, prompt_ids: list[int] | None = None
                 ) -> Response:
    prompt, ids, params, plan = await prepare_chat(ctx, chat, raw_prompt=raw_prompt,
                                                   prompt_ids=prompt_ids)
    parser = choice_parsers(chat, prompt, plan, ctx.reasoning_parser,
                            ctx.tool_call_parser)[0].parser
    outputs = ctx.engine.generate(f"ollama-{uuid.uuid4().hex}", prompt, ids, params)
    if chat.sampling.stream:
        return StreamingResponse(with_error_lines(reply_lines(outputs, parser, shape,
                                                              len(ids))), media_type=NDJSON)
    out = await until_disconnect(raw, collect(outputs))
    sample = out.outputs[0]
    parsed = parser.parse(sample.text)
    calls = [tool_call(call.name, call.arguments) for call in parsed.tool_calls]
    return JSONResponse({**shape.head(),
                         **shape.body(parsed.content or "", parsed.reasoning or "", calls),
                         **shape.final(sample.finish_reason, out.metrics, len(ids),
                                       len(sample.token_ids))})

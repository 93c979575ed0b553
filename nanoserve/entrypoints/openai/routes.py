"""OpenAI's routes on a model's server: models, completions, chat completions, tokenize and
detokenize, vLLM's router endpoints, and the server's health, version and metrics."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

import nanoserve
from nanoserve.entrypoints.openai.chat_request import chat_input
from nanoserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nanoserve.entrypoints.openai.response_models import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from nanoserve.entrypoints.openai.router_endpoints import add_router_routes
from nanoserve.entrypoints.openai.serving_chat import create_chat_completion
from nanoserve.entrypoints.openai.serving_completion import create_completion
from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.openapi import GENERATE_ERRORS, responses
from nanoserve.entrypoints.serving.prepare import chat_prompt_ids
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.entrypoints.serving.token_limits import check_prompt_ids


def add_openai_routes(app: FastAPI, ctx: ServerContext) -> None:
    """OpenAI's routes, vLLM's extras and the server's own (health, version, metrics)."""
    @app.get("/health", response_class=Response, responses={
        200: {"description": "the engine is running"},
        503: {"description": "the engine is dead or the server is shutting down"}})
    async def health() -> Response:
        return Response(status_code=503 if ctx.engine.is_dead or ctx.shutting_down else 200)

    @app.get("/version", responses=responses(VersionResponse, 401))
    async def version() -> dict[str, str]:
        return {"version": nanoserve.__version__}

    @app.get("/v1/models", responses=responses(ModelList, 401))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": 0, "owned_by": "nanoserve",
            "root": ctx.model_name, "max_model_len": ctx.max_model_len,
            "input_modalities": ctx.input_modalities}]}

    @app.post("/v1/completions", response_model=None,
              responses=responses(CompletionResponse, *GENERATE_ERRORS, streams=True))
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions", response_model=None,
              responses=responses(ChatCompletionResponse, *GENERATE_ERRORS, streams=True))
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    add_router_routes(app, ctx)  # render, server info: what a router in front asks

    @app.post("/tokenize", responses=responses(TokenizeResponse, 400, 401, 404, 413))
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         chat_template_kwargs=req.chat_template_kwargs,
                                         tools=req.tools)
            _, ids = await chat_prompt_ids(ctx, chat_input(chat))
        elif req.prompt is not None:
            ids = ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("give prompt or messages", "prompt")
        body: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len,
                                "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize", responses=responses(DetokenizeResponse, 400, 401, 404, 413))
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        ctx.check_model(req.model)
        if req.tokens:
            check_prompt_ids(ctx, req.tokens)
        return {"prompt": ctx.tokenizer.decode(req.tokens)}

    # (Response, not PlainTextResponse: its 401 is JSON like every other error)
    @app.get("/metrics", response_class=Response,
             responses=responses(None, 401, media_type="text/plain"))
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

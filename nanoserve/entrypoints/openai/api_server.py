"""The FastAPI app: routes, error handlers, auth, and the lifetime of one API-server process."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

import nanoserve
from nanoserve.entrypoints.async_engine import EngineDeadError
from nanoserve.entrypoints.openai.auth import APIKeyMiddleware
from nanoserve.entrypoints.openai.errors import (
    APIError,
    api_error_handler,
    bad_request,
    error_body,
    validation_error_handler,
)
from nanoserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nanoserve.entrypoints.openai.serving_chat import create_chat_completion, render_prompt
from nanoserve.entrypoints.openai.serving_common import ServerContext, check_prompt_ids
from nanoserve.entrypoints.openai.serving_completion import create_completion

logger = logging.getLogger("nanoserve")


def build_app(ctx: ServerContext, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="nanoserve", version=nanoserve.__version__, docs_url=None,
                  redoc_url=None)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(503, f"the engine stopped: {exc}"), status_code=503)

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if ctx.engine.is_dead or ctx.shutting_down else 200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": nanoserve.__version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": 0, "owned_by": "nanoserve",
            "root": ctx.model_name, "max_model_len": ctx.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt,
                                         continue_final_message=req.continue_final_message,
                                         chat_template_kwargs=req.chat_template_kwargs,
                                         tools=req.tools)
            ids = ctx.tokenizer.encode(render_prompt(ctx, chat), add_special_tokens=False)
        elif req.prompt is not None:
            ids = ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("give prompt or messages", "prompt")
        body: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len,
                                "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        ctx.check_model(req.model)
        if req.tokens:
            check_prompt_ids(ctx, req.tokens)
        return {"prompt": ctx.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


async def drain(ctx: ServerContext, timeout: float) -> None:
    """Wait (bounded) for in-flight requests before the process stops."""
    ctx.shutting_down = True
    deadline = asyncio.get_running_loop().time() + timeout
    while ctx.engine.num_in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if ctx.engine.num_in_flight:
        logger.warning("shutting down with %d requests still in flight",
                       ctx.engine.num_in_flight)

"""The FastAPI app: routes, error handlers, auth, and the lifetime of one API-server process."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import nanoserve
from nanoserve.config import ServerConfig
from nanoserve.entrypoints.anthropic.routes import add_messages_routes
from nanoserve.entrypoints.async_engine import EngineDeadError, RequestTimeoutError
from nanoserve.entrypoints.edge_middleware import add_edge_middleware
from nanoserve.entrypoints.ollama.json_bodies import OllamaJsonBodies
from nanoserve.entrypoints.ollama.routes import add_ollama_routes
from nanoserve.entrypoints.openai.auth import PUBLIC_PATHS
from nanoserve.entrypoints.openai.chat_prompt import render_prompt
from nanoserve.entrypoints.openai.chat_request import chat_input
from nanoserve.entrypoints.openai.errors import (
    APIError,
    api_error_handler,
    bad_request,
    error_body,
    http_error_handler,
    validation_error_handler,
)
from nanoserve.entrypoints.openai.limits import BodyLimitMiddleware
from nanoserve.entrypoints.openai.openapi import GENERATE_ERRORS, install_openapi, responses
from nanoserve.entrypoints.openai.pooling.routes import add_pooling_routes
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
from nanoserve.entrypoints.openai.responses.routes import add_responses_routes
from nanoserve.entrypoints.openai.router_endpoints import add_router_routes
from nanoserve.entrypoints.openai.server_context import ServerContext
from nanoserve.entrypoints.openai.serving_chat import create_chat_completion
from nanoserve.entrypoints.openai.serving_completion import create_completion
from nanoserve.entrypoints.openai.token_limits import check_prompt_ids
from nanoserve.entrypoints.tenant import TenantMiddleware
from nanoserve.entrypoints.web.router import PUBLIC_PATHS as WEB_PUBLIC_PATHS
from nanoserve.entrypoints.web.router import WebPageInfo, web_defaults_router, web_router

logger = logging.getLogger("nanoserve")


def build_app(ctx: ServerContext, config: ServerConfig | None = None) -> FastAPI:
    """The routes, with errors in OpenAI's shape and the middleware `config` asks for."""
    config = config or ServerConfig()
    app = FastAPI(title="nanoserve", version=nanoserve.__version__, docs_url=None,
                  redoc_url=None)
    add_error_handlers(app)
    add_routes(app, ctx)
    add_pooling_routes(app, ctx, config.score_method)  # embeddings, rerank, score
    add_messages_routes(app, ctx, strip_billing_header=config.strip_billing_header)
    add_ollama_routes(app, ctx)  # Ollama's /api/*
    public_paths = PUBLIC_PATHS
    app.include_router(web_defaults_router(lambda: WebPageInfo(
        ctx.model_name, ctx.max_model_len, ctx.reasoning_parser, ctx.generation_defaults)))
    if config.web_ui:  # the chat page and dashboard: public files, keyed calls
        app.include_router(web_router())
        public_paths = public_paths | WEB_PUBLIC_PATHS
    install_openapi(app)
    # the last added runs first: CORS answers browsers' preflights before the key is asked
    # for, and the key is checked before a large body is read
    app.add_middleware(BodyLimitMiddleware, limit=config.limits.max_request_body_bytes)
    app.add_middleware(OllamaJsonBodies)  # Ollama's bodies are JSON whatever their type
    app.add_middleware(TenantMiddleware)  # whose key: for proposers that learn across requests
    add_edge_middleware(app, config, public_paths)  # the key, CORS, the error shapes
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app answers is OpenAI's error object, never `{"detail": ...}`."""
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(503, f"the engine stopped: {exc}"), status_code=503)

    @app.exception_handler(RequestTimeoutError)
    async def timed_out(_: Request, exc: Exception) -> JSONResponse:
        # 408, as LiteLLM answers a timed-out call; the OpenAI SDK retries it like a 5xx
        return JSONResponse(error_body(408, str(exc)), status_code=408)

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # a bug, not the client's fault: the shape clients parse, without internals (the
        # traceback goes to the log, re-raised by Starlette after this answer)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"),
                            status_code=500)


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
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
            "root": ctx.model_name, "max_model_len": ctx.max_model_len}]}

    @app.post("/v1/completions", response_model=None,
              responses=responses(CompletionResponse, *GENERATE_ERRORS, streams=True))
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(ctx, req, raw)

    @app.post("/v1/chat/completions", response_model=None,
              responses=responses(ChatCompletionResponse, *GENERATE_ERRORS, streams=True))
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(ctx, req, raw)

    add_responses_routes(app, ctx)
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
            ids = ctx.tokenizer.encode(render_prompt(ctx, chat_input(chat)),
                                       add_special_tokens=False)
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


async def drain(ctx: ServerContext, timeout: float) -> None:
    """Wait (bounded) for in-flight requests before the process stops."""
    ctx.shutting_down = True
    deadline = asyncio.get_running_loop().time() + timeout
    while ctx.engine.num_in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if ctx.engine.num_in_flight:
        logger.warning("shutting down with %d requests still in flight",
                       ctx.engine.num_in_flight)

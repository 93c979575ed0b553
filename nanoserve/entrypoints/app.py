"""A model's HTTP app: every wire format's routes over the one serving pipeline (openai/,
responses/, anthropic/, ollama/, llamacpp/, the pooling routes, the web pages), the error
handlers, and the middleware in the order it must run. The top floor: it may import every folder of
entrypoints/, and none imports it."""

from __future__ import annotations

from fastapi import FastAPI

import nanoserve
from nanoserve.entrypoints.anthropic.routes import add_messages_routes
from nanoserve.entrypoints.edge.middleware import add_edge_middleware
from nanoserve.entrypoints.llamacpp.routes import add_llamacpp_routes
from nanoserve.entrypoints.ollama.json_bodies import OllamaJsonBodies
from nanoserve.entrypoints.ollama.routes import add_ollama_routes
from nanoserve.entrypoints.openai.pooling.routes import add_pooling_routes
from nanoserve.entrypoints.openai.routes import add_openai_routes
from nanoserve.entrypoints.responses.routes import add_responses_routes
from nanoserve.entrypoints.serving.auth import PUBLIC_PATHS
from nanoserve.entrypoints.serving.error_handlers import add_error_handlers
from nanoserve.entrypoints.serving.limits import BodyLimitMiddleware
from nanoserve.entrypoints.serving.openapi import install_openapi
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.entrypoints.serving.tenant import TenantMiddleware
from nanoserve.entrypoints.web.router import PUBLIC_PATHS as WEB_PUBLIC_PATHS
from nanoserve.entrypoints.web.router import WebPageInfo, web_defaults_router, web_router
from nanoserve.server_config import ServerConfig


def build_app(ctx: ServerContext, config: ServerConfig | None = None) -> FastAPI:
    """The routes, with errors in OpenAI's shape and the middleware `config` asks for."""
    config = config or ServerConfig()
    app = FastAPI(title="nanoserve", version=nanoserve.__version__, docs_url=None,
                  redoc_url=None)
    add_error_handlers(app)
    add_openai_routes(app, ctx)
    add_responses_routes(app, ctx)
    add_pooling_routes(app, ctx, config.score_method)  # embeddings, rerank, score
    add_messages_routes(app, ctx, strip_billing_header=config.strip_billing_header)
    add_ollama_routes(app, ctx)  # Ollama's /api/*
    add_llamacpp_routes(app, ctx)  # llama-server's /infill
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

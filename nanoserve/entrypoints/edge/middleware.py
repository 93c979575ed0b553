"""The middleware every HTTP app of nanoserve ends with (a model's server, and the router of
`--models-dir` in front of several): the API key, CORS, and each API's error shape.

Added last, so they run first: CORS answers browsers' preflights before the key is asked for;
outermost, every error on the Messages paths is in Anthropic's shape and on `/api/` in
Ollama's, the 401s and 413s too (a body already in its shape, relayed by the router from a
model's server, passes unchanged).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from nanoserve.entrypoints.anthropic.errors import AnthropicErrorShape
from nanoserve.entrypoints.ollama.errors import OllamaErrorShape
from nanoserve.entrypoints.serving.auth import APIKeyMiddleware
from nanoserve.server_config import ServerConfig


def add_edge_middleware(app: FastAPI, config: ServerConfig,
                        public_paths: frozenset[str]) -> None:
    """The key (`public_paths` need none), CORS where origins are allowed, the error shapes."""
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys,
                           public_paths=public_paths)
    if config.allowed_origins:  # off by default: no page elsewhere may call the API
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(AnthropicErrorShape)
    app.add_middleware(OllamaErrorShape)

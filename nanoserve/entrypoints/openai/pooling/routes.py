"""The pooling routes on the app: /v1/embeddings, /v1/rerank (/rerank, /v2/rerank), /score."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nanoserve.entrypoints.openai.pooling.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from nanoserve.entrypoints.openai.pooling.serving_embedding import create_embedding
from nanoserve.entrypoints.openai.pooling.serving_score import (
    SCORE_METHODS,
    create_rerank,
    create_score,
)
from nanoserve.entrypoints.serving.openapi import GENERATE_ERRORS, responses
from nanoserve.entrypoints.serving.server_context import ServerContext


def add_pooling_routes(app: FastAPI, ctx: ServerContext, score_method: str) -> None:
    """Register the embedding, rerank and score routes; `score_method` is --score-method
    (ServerConfig.score_method)."""
    if score_method not in SCORE_METHODS:
        raise ValueError(f"score_method={score_method!r} is not one of {list(SCORE_METHODS)}")

    @app.post("/v1/embeddings", responses=responses(EmbeddingResponse, *GENERATE_ERRORS))
    async def embeddings(req: EmbeddingRequest, raw: Request) -> JSONResponse:
        return await create_embedding(ctx, req, raw)

    async def rerank(req: RerankRequest, raw: Request) -> JSONResponse:
        return await create_rerank(ctx, req, raw, score_method)

    # one handler on Jina's and vLLM's paths (versioned and not) and Cohere's v2: same fields
    for path, name in (("/v1/rerank", "rerank"), ("/rerank", "rerank_unversioned"),
                       ("/v2/rerank", "rerank_v2")):
        app.add_api_route(path, rerank, methods=["POST"], name=name,
                          responses=responses(RerankResponse, *GENERATE_ERRORS))

    @app.post("/score", responses=responses(ScoreResponse, *GENERATE_ERRORS))
    async def score(req: ScoreRequest, raw: Request) -> JSONResponse:
        return await create_score(ctx, req, raw, score_method)

"""The pooling routes on the app: /v1/embeddings, /v1/rerank (/rerank, /v2/rerank), /score."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from nanoserve.entrypoints.openai.openapi import GENERATE_ERRORS, responses
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
from nanoserve.entrypoints.openai.server_context import ServerContext


def add_pooling_routes(app: FastAPI, ctx: ServerContext, score_method: str) -> None:
    """Register the embedding, rerank and score routes; `score_method` is --score-method
    (ServerConfig.score_method)."""
    if score_method not in SCORE_METHODS:
        raise ValueError(f"score_method={score_method!r} is not one of {list(SCORE_METHODS)}")

    @app.post("/v1/embeddings", responses=responses(EmbeddingResponse, *GENERATE_ERRORS))
    async def embeddings(req: EmbeddingRequest, raw: Request) -> JSONResponse:
        return await create_embedding(ctx, req, raw)

    @app.post("/v1/rerank", responses=responses(RerankResponse, *GENERATE_ERRORS))
    async def rerank(req: RerankRequest, raw: Request) -> JSONResponse:
        return await create_rerank(ctx, req, raw, score_method)

    # Jina's and vLLM's unversioned path, and Cohere's v2 (the same fields)
    @app.post("/rerank", responses=responses(RerankResponse, *GENERATE_ERRORS))
    async def rerank_unversioned(req: RerankRequest, raw: Request) -> JSONResponse:
        return await create_rerank(ctx, req, raw, score_method)

    @app.post("/v2/rerank", responses=responses(RerankResponse, *GENERATE_ERRORS))
    async def rerank_v2(req: RerankRequest, raw: Request) -> JSONResponse:
        return await create_rerank(ctx, req, raw, score_method)

    @app.post("/score", responses=responses(ScoreResponse, *GENERATE_ERRORS))
    async def score(req: ScoreRequest, raw: Request) -> JSONResponse:
        return await create_score(ctx, req, raw, score_method)

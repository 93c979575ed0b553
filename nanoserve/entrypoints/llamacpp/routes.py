"""llama-server's own routes on a model's server: `/infill` (code completion)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from nanoserve.entrypoints.llamacpp.infill import create_infill
from nanoserve.entrypoints.llamacpp.protocol import InfillRequest, InfillResponse
from nanoserve.entrypoints.serving.openapi import GENERATE_ERRORS, responses
from nanoserve.entrypoints.serving.server_context import ServerContext


def add_llamacpp_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/infill", response_model=None,
              responses=responses(InfillResponse, *GENERATE_ERRORS, streams=True))
    async def infill(req: InfillRequest, raw: Request) -> Response:
        return await create_infill(ctx, req, raw)

"""The Responses API's route on a model's app (`app.build_app` adds it)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from nanoserve.entrypoints.responses.protocol import ResponseBody, ResponsesRequest
from nanoserve.entrypoints.responses.serving import create_response
from nanoserve.entrypoints.serving.openapi import GENERATE_ERRORS, responses
from nanoserve.entrypoints.serving.server_context import ServerContext


def add_responses_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`POST /v1/responses` (stateless: no GET or DELETE of stored responses)."""

    @app.post("/v1/responses", response_model=None,
              responses=responses(ResponseBody, *GENERATE_ERRORS, streams=True))
    async def create(req: ResponsesRequest, raw: Request) -> Response:
        return await create_response(ctx, req, raw)

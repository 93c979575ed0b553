"""The Responses API's route on the app (`api_server.add_routes` calls this)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from nanoserve.entrypoints.openai.openapi import GENERATE_ERRORS, responses
from nanoserve.entrypoints.openai.responses.protocol import ResponseBody, ResponsesRequest
from nanoserve.entrypoints.openai.responses.serving import create_response
from nanoserve.entrypoints.openai.server_context import ServerContext


def add_responses_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`POST /v1/responses` (stateless: no GET or DELETE of stored responses)."""

    @app.post("/v1/responses", response_model=None,
              responses=responses(ResponseBody, *GENERATE_ERRORS, streams=True))
    async def create(req: ResponsesRequest, raw: Request) -> Response:
        return await create_response(ctx, req, raw)

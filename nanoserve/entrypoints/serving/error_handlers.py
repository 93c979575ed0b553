"""Every error an app answers, in OpenAI's error shape (the edge reshapes it on another API's
paths: entrypoints/edge/), and the drain of a stopping server."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.entrypoints.serving.engine_errors import SERVING_ERRORS, api_error_of
from nanoserve.entrypoints.serving.errors import (
    APIError,
    api_error_handler,
    error_body,
    http_error_handler,
    validation_error_handler,
)
from nanoserve.entrypoints.serving.server_context import ServerContext

logger = logging.getLogger("nanoserve")


def add_error_handlers(app: FastAPI) -> None:
    """Every error the app answers is OpenAI's error object, never `{"detail": ...}`."""
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)

    for error_type in SERVING_ERRORS[1:]:  # (APIError's own handler above)
        app.add_exception_handler(error_type, serving_error)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # a bug, not the client's fault: the shape clients parse, without internals (the
        # traceback goes to the log, re-raised by Starlette after this answer)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"),
                            status_code=500)


async def serving_error(_: Request, exc: Exception) -> JSONResponse:
    error = api_error_of(exc)
    return JSONResponse(error.body(), status_code=error.status)


async def drain(ctx: ServerContext, timeout: float) -> None:
    """Wait (bounded) for in-flight requests before the process stops."""
    ctx.shutting_down = True
    deadline = asyncio.get_running_loop().time() + timeout
    while ctx.engine.num_in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if ctx.engine.num_in_flight:
        logger.warning("shutting down with %d requests still in flight",
                       ctx.engine.num_in_flight)

"""Ollama's model store on the router: `/api/pull` and `/api/delete`, as Ollama answers them.

- `POST /api/pull {"model": NAME, "stream": true}`: NDJSON progress lines (`status`, and for a
  file `digest`, `total`, `completed`), the last `{"status": "success"}`; a failure is a line
  `{"error": "..."}` (the status is already 200). With `"stream": false`, one answer once it is
  over: `{"status": "success"}`, or `{"error": ...}` with a 500 (Ollama's). A name that is no
  model name is a 400 `invalid model name`. The pull runs whether or not the router was started
  with --allow-pull (that flag is about requests that name a model nobody pulled), and goes on
  while any client that asked for it is there (pulls.py).
- `DELETE /api/delete {"model": NAME}`: unloads the model once its running requests end and
  removes it from the store; 200 with no body, 404 `model 'NAME' not found`; a directory's
  model is a 400 (its file is the user's).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.entrypoints.router.forward import body_fields
from nanoserve.entrypoints.router.pulled_models import PulledModels
from nanoserve.model.sources.errors import ModelSourceError
from nanoserve.model.sources.names import parse_model_name

NDJSON = "application/x-ndjson"


def add_ollama_pull_routes(app: FastAPI, pulled: PulledModels) -> None:
    @app.post("/api/pull", response_model=None)
    async def pull(request: Request) -> Response:
        fields = body_fields(await request.body())
        asked = _asked(fields)
        if asked is None or parse_model_name(asked) is None:
            return _error(400, "invalid model name")
        if fields.get("stream") is False:
            try:
                await pulled.pulls.pull(asked)
            except ModelSourceError as e:
                return _error(500, str(e))
            return JSONResponse({"status": "success"})
        return StreamingResponse(_progress_lines(pulled, asked), media_type=NDJSON)

    @app.delete("/api/delete", response_model=None)
    async def delete(request: Request) -> Response:
        asked = _asked(body_fields(await request.body()))
        if asked is None:
            return _error(400, "model is required")
        try:
            if not await pulled.delete(asked):
                return _error(404, f"model '{asked}' not found")
        except ValueError as e:
            return _error(400, str(e))
        return Response(status_code=200)


async def _progress_lines(pulled: PulledModels, asked: str) -> AsyncIterator[bytes]:
    """The pull's events as NDJSON lines, ending with `success` (or the error)."""
    last = None
    try:  # closed with the response: a client that leaves leaves the pull
        async with contextlib.aclosing(pulled.pulls.events(asked)) as events:
            async for event in events:
                last = event.status
                yield _line(event.to_json())
    except ModelSourceError as e:
        yield _line({"error": str(e)})
        return
    if last != "success":  # a source that ends without saying so
        yield _line({"status": "success"})


def _asked(fields: dict[str, Any]) -> str | None:
    """The body's `model` (or its older spelling, `name`)."""
    asked = fields.get("model") or fields.get("name")
    return asked if isinstance(asked, str) and asked else None


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)

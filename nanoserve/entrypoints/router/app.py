"""The router's HTTP app: its own endpoints (the models and their states, loading and unloading
by hand, /metrics over every loaded model, the chat page and dashboard), and every other path
forwarded to the server of the model the request names (forward.py).

Endpoints, as llama-server's router mode spells them:
- `GET /v1/models` (and `/models`): every model in the directory and every pulled one, each
  with `status: {"value": "loaded" | "loading" | "unloading" | "unloaded"}` (and `failure`, the
  reason its last load failed, if it did); a model being pulled, with
  `status: {"value": "pulling", "progress": {...}}` (its last event, as /api/pull's lines).
- `POST /models/load` / `POST /models/unload` `{"model": NAME}`: answer once it is loaded, or
  once its running requests have ended and its server is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import nanoserve
from nanoserve.engine.kv_disk import disk_usage_by_model
from nanoserve.entrypoints.edge.middleware import add_edge_middleware
from nanoserve.entrypoints.router.catalog import input_modalities
from nanoserve.entrypoints.router.forward import (
    RouteError,
    auth_headers,
    body_fields,
    error_response,
    forward,
    take_lease,
)
from nanoserve.entrypoints.router.metrics_merge import merge_expositions
from nanoserve.entrypoints.router.ollama_pull import add_ollama_pull_routes
from nanoserve.entrypoints.router.ollama_routes import add_ollama_router_routes, ollama_keep_alive
from nanoserve.entrypoints.router.pool import ModelPool, ModelState
from nanoserve.entrypoints.router.pulled_models import PulledModels
from nanoserve.entrypoints.serving.auth import PUBLIC_PATHS
from nanoserve.entrypoints.serving.limits import BodyLimitMiddleware
from nanoserve.entrypoints.web.router import PUBLIC_PATHS as WEB_PUBLIC_PATHS
from nanoserve.entrypoints.web.router import web_router
from nanoserve.server_config import ServerConfig

_METRICS_TIMEOUT_S = 5.0


def build_router_app(pool: ModelPool, config: ServerConfig, pulled: PulledModels) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=64))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        pool.start()
        try:
            yield
        finally:
            pulled.pulls.close()
            await pool.close()
            await client.aclose()

    app = FastAPI(title="nanoserve router", version=nanoserve.__version__, docs_url=None,
                  redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(RouteError)
    async def route_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RouteError)
        return error_response(exc.status, exc.message)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": nanoserve.__version__}

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> dict[str, Any]:
        await pulled.refresh()
        cards = [model_card(pool, name) for name, e in pool.entries.items() if not e.removed]
        cards += [_pulling_card(name, status) for name, status in pulled.pulls.status().items()
                  if name not in pool.entries]
        return {"object": "list", "data": cards}

    @app.post("/models/load")
    async def load(request: Request) -> dict[str, Any]:
        fields = body_fields(await request.body())
        _named_model(fields)
        name = await pulled.find(request.url.path, fields, None)
        lease = await take_lease(pool, name)
        await pool.release(lease)
        return {"success": True, "model": name, "status": {"value": "loaded"}}

    @app.post("/models/unload")
    async def unload(request: Request) -> dict[str, Any]:
        asked = _named_model(body_fields(await request.body()))
        name = pool.names.resolve(asked) or _unknown(asked)
        await pool.unload(name)
        return {"success": True, "model": name, "status": {"value": "unloaded"}}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        auth = auth_headers(request)
        servers = [e.server for e in pool.entries.values()
                   if e.state is ModelState.LOADED and e.server is not None]

        async def scrape(url: str) -> str:
            with contextlib.suppress(httpx.HTTPError):
                answer = await client.get(url + "/metrics", headers=auth,
                                          timeout=_METRICS_TIMEOUT_S)
                if answer.status_code == 200:
                    return answer.text
            return ""  # a server stopping as we ask: its series are simply absent

        texts = await asyncio.gather(*(scrape(s.url) for s in servers))
        return Response(merge_expositions(list(texts)),
                        media_type="text/plain; version=0.0.4")

    add_ollama_router_routes(app, pool, client, pulled)
    add_ollama_pull_routes(app, pulled)
    public_paths = PUBLIC_PATHS
    if config.web_ui:  # the pages here; their /web/defaults comes from the chosen model
        app.include_router(web_router())
        public_paths = public_paths | WEB_PUBLIC_PATHS

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def to_model(request: Request, path: str) -> Response:
        body = await request.body()
        fields = body_fields(body)
        name = await pulled.find(request.url.path, fields, request.query_params.get("model"))
        keep_alive = ollama_keep_alive(request.url.path, fields)
        lease = await take_lease(pool, name, keep_alive)
        return await forward(request, client, pool, lease, body)

    app.add_middleware(BodyLimitMiddleware, limit=config.limits.max_request_body_bytes)
    add_edge_middleware(app, config, public_paths)  # the router's own 401s in each shape
    return app


def model_card(pool: ModelPool, name: str) -> dict[str, Any]:
    """One model as `/v1/models` lists it, with its state (llama-server's router mode's
    `status` object)."""
    entry = pool.entries[name]
    status: dict[str, Any] = {"value": entry.state.value}
    if entry.failure is not None and entry.state is ModelState.UNLOADED:
        status["failure"] = entry.failure
    disk = _disk_folder(pool.child_args)
    if disk is not None:  # warm on disk: the prefix cache's files a restart would read
        files, size = disk_usage_by_model(disk).get(str(entry.path.resolve()), (0, 0))
        status["kv_disk"] = {"files": files, "bytes": size}
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0,
                            "owned_by": "nanoserve", "root": name, "path": str(entry.path),
                            "input_modalities": input_modalities(entry.path), "status": status}
    if entry.expires_at is not None and entry.state is ModelState.LOADED:
        card["expires_in"] = max(round(entry.expires_at - time.time(), 1), 0.0)
    return card


def _disk_folder(args: list[str]) -> Path | None:
    """The `--kv-cache-disk` folder every model's server is given, if any."""
    for i, arg in enumerate(args):
        if arg.startswith("--kv-cache-disk="):
            return Path(arg.split("=", 1)[1])
        if arg == "--kv-cache-disk" and i + 1 < len(args):
            return Path(args[i + 1])
    return None


def _pulling_card(name: str, status: dict[str, Any]) -> dict[str, Any]:
    """A model being pulled, as `/v1/models` lists it until it is here."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "nanoserve",
            "root": name, "status": status}


def _named_model(fields: dict[str, Any]) -> str:
    """The `model` of a /models/load or /models/unload body."""
    asked = fields.get("model")
    if not isinstance(asked, str):
        raise RouteError(400, "give the model to load or unload: {\"model\": NAME}")
    return asked


def _unknown(asked: str) -> NoReturn:
    raise RouteError(404, f"The model `{asked}` does not exist.")

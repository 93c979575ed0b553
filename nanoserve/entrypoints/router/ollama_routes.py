"""Ollama's API where it is about several models: the router answers `/api/tags` (every model
in the directory and every pulled one), `/api/ps` (the loaded ones, with when each unloads)
and `/api/version` itself, and reads each request's `keep_alive`. `/api/chat`, `/api/generate`,
`/api/embed` and `/api/show` go to the model's own server, which speaks Ollama's API
(entrypoints/ollama/). `/api/pull` and `/api/delete` are ollama_pull.py's.

An empty `/api/generate` or `/api/chat` (no prompt, no messages) only loads the model, or with
`keep_alive: 0` unloads it, as Ollama's do: the unload is answered here, without loading it
first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from nanoserve.entrypoints.ollama.keep_alive import parse_keep_alive
from nanoserve.entrypoints.ollama.model_card import (
    OLLAMA_API_VERSION,
    ModelCard,
    read_model_card,
    rfc3339,
)
from nanoserve.entrypoints.router.forward import (
    RouteError,
    auth_headers,
    body_fields,
    forward,
    take_lease,
)
from nanoserve.entrypoints.router.pool import DEFAULT, KeepAlive, ModelPool, ModelState
from nanoserve.entrypoints.router.pulled_models import PulledModels
from nanoserve.entrypoints.serving.errors import APIError
from nanoserve.model.sources.store import PulledModel

# the paths whose bodies carry `keep_alive` in Ollama's API
_KEEP_ALIVE_PATHS = frozenset({"/api/chat", "/api/generate", "/api/embed", "/api/embeddings"})


def ollama_keep_alive(path: str, fields: dict[str, Any]) -> KeepAlive:
    """The request's `keep_alive` in seconds (None: keep it loaded), or DEFAULT where it sets
    none or is not an Ollama request. A value Ollama would refuse is a 400 naming it."""
    if path not in _KEEP_ALIVE_PATHS or fields.get("keep_alive") is None:
        return DEFAULT
    try:
        return parse_keep_alive(fields["keep_alive"])
    except APIError as e:
        raise RouteError(e.status, e.message) from e


def _listed(name: str, card: ModelCard, pulled: PulledModel | None) -> dict[str, Any]:
    """A model as /api/tags lists it (the fields of the model's own server's /api/tags); a
    pulled one with its pull's time, size on disk and digest (bare hex, as Ollama's)."""
    details = {"parent_model": "", "format": "", "family": "", "families": None,
               "parameter_size": "", "quantization_level": "", **card.details}
    listed = {"name": name, "model": name, "modified_at": card.modified_at, "size": card.size,
              "digest": card.digest, "details": details}
    if pulled is not None:
        listed.update(modified_at=rfc3339(pulled.modified_at), size=pulled.size,
                      digest=pulled.digest.removeprefix("sha256:") or card.digest)
    return listed


def add_ollama_router_routes(app: FastAPI, pool: ModelPool, client: httpx.AsyncClient,
                             pulled: PulledModels) -> None:
    cards: dict[Path, ModelCard] = {}  # read on first use (a GGUF file's header: ~1 s)

    def card(path: Path) -> ModelCard:
        if path not in cards:
            cards[path] = read_model_card(str(path))
        return cards[path]

    @app.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}

    @app.get("/api/tags")
    async def tags() -> dict[str, Any]:
        await pulled.refresh()
        entries = [e for e in pool.entries.values() if not e.removed]
        listed = await asyncio.to_thread(
            lambda: [_listed(e.name, card(e.path), pulled.records.get(e.name))
                     for e in entries])
        return {"models": listed}

    @app.get("/api/ps")
    async def ps(request: Request) -> dict[str, Any]:
        """Each loaded model's own /api/ps entry (its context length is its server's), with
        when the router will unload it."""
        auth = auth_headers(request)
        loaded = [e for e in pool.entries.values()
                  if e.state is ModelState.LOADED and e.server is not None]

        async def entry_of(url: str) -> dict[str, Any] | None:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
                answer = await client.get(url + "/api/ps", headers=auth, timeout=5.0)
                return dict(answer.json()["models"][0])
            return None  # stopping as we ask

        found = await asyncio.gather(*(entry_of(e.server.url) for e in loaded
                                       if e.server is not None))
        models = []
        for entry, model in zip(loaded, found, strict=True):
            if model is not None:
                if entry.expires_at is not None:
                    model["expires_at"] = rfc3339(entry.expires_at)
                models.append(model)
        return {"models": models}

    async def load_or_unload(request: Request, field: str) -> Response | dict[str, Any]:
        body = await request.body()
        fields = body_fields(body)
        keep_alive = ollama_keep_alive(request.url.path, fields)
        name = await pulled.find(request.url.path, fields, None)
        if not fields.get(field) and keep_alive == 0:
            await pool.unload(name)
            answer: dict[str, Any] = {"model": name, "created_at": rfc3339(time.time()),
                                      "done": True, "done_reason": "unload"}
            if field == "messages":
                answer["message"] = {"role": "assistant", "content": ""}
            else:
                answer["response"] = ""
            return answer
        lease = await take_lease(pool, name, keep_alive)
        return await forward(request, client, pool, lease, body)

    @app.post("/api/generate", response_model=None)
    async def generate(request: Request) -> Response | dict[str, Any]:
        return await load_or_unload(request, "prompt")

    @app.post("/api/chat", response_model=None)
    async def chat(request: Request) -> Response | dict[str, Any]:
        return await load_or_unload(request, "messages")

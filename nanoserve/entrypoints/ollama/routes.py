"""Ollama's routes on the server's app (`/api/...`, Ollama's docs/api.md): version, the model
listings (tags, ps, show), chat, generate and embeddings, for the one model the server runs.
A pull of that model answers `success` at once (it is here: clients that pull before they chat
work, Codex's `--oss` among them); a pull of another name is a 404, and the other routes that
manage Ollama's model store (push, create, copy, delete, blobs) a 400, each saying where models
are pulled (a router of --models-dir, router/ollama_pull.py). Errors take Ollama's shape
(`errors.py`); the API key, the body limit and the capacity checks are the server's, as on
every route.

`/api/version` is the Ollama release whose API these routes answer, not nanoserve's own
(`/version`): clients read it to decide what the server can do.
"""

from __future__ import annotations

import functools
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from nanoserve.entrypoints.ollama.model_card import OLLAMA_API_VERSION, ModelCard, read_model_card
from nanoserve.entrypoints.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from nanoserve.entrypoints.ollama.response_models import (
    OllamaChatReply,
    OllamaEmbeddingReply,
    OllamaEmbedReply,
    OllamaErrorResponse,
    OllamaGenerateReply,
    OllamaRunning,
    OllamaShow,
    OllamaTags,
    OllamaVersion,
)
from nanoserve.entrypoints.ollama.serving import NDJSON, check_model, create_chat, create_generate
from nanoserve.entrypoints.ollama.serving_embed import create_embed, create_embeddings
from nanoserve.entrypoints.serving.errors import APIError, bad_request
from nanoserve.entrypoints.serving.server_context import ServerContext

_REASONS = {
    400: "a field is invalid; the message names it",
    401: "no API key or a wrong one (with --api-key; Authorization: Bearer)",
    404: "`model` names another model than the one served",
    408: "the request ran past --request-timeout",
    413: "the body is larger than --max-request-body-bytes",
    429: "the server is at --max-in-flight; retry later",
    503: "the engine is not running, or the server is shutting down",
}
_GENERATE_ERRORS = tuple(_REASONS)
# Ollama's own "forever" (keep_alive < 0) is now plus Go's largest duration, ~292 years
_FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)
# the sampling defaults /api/show names, in Ollama's words
_PARAMETER_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                    "min_p": "min_p", "repetition_penalty": "repeat_penalty"}
_STORE_ROUTES = (("/api/push", "POST"), ("/api/create", "POST"),
                 ("/api/copy", "POST"), ("/api/delete", "DELETE"),
                 ("/api/blobs/{digest}", "POST"), ("/api/blobs/{digest}", "HEAD"))


def _responses(model: type, *errors: int, streams: bool = False
               ) -> dict[int | str, dict[str, Any]]:
    ok: dict[str, Any] = {"description": "success", "model": model}
    if streams:
        ok["description"] = "the whole reply, or by default NDJSON: one such object a line"
        ok["content"] = {NDJSON: {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
    out: dict[int | str, dict[str, Any]] = {200: ok}
    for status in errors:
        out[status] = {"model": OllamaErrorResponse, "description": _REASONS[status]}
    return out


def add_ollama_routes(app: FastAPI, ctx: ServerContext) -> None:
    """Ollama's routes for `ctx`'s model; its card (`model_card.py`) is read when first
    asked for, once (milliseconds: the file's header only)."""

    @functools.cache
    def card() -> ModelCard:
        return read_model_card(ctx.model_path)

    @app.get("/api/version", responses=_responses(OllamaVersion, 401))
    async def ollama_version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}

    @app.get("/api/tags", responses=_responses(OllamaTags, 401))
    async def ollama_tags() -> dict[str, Any]:
        return {"models": [{"name": ctx.model_name, "model": ctx.model_name,
                            "modified_at": card().modified_at, "size": card().size,
                            "digest": card().digest, "details": _details(card())}]}

    @app.get("/api/ps", responses=_responses(OllamaRunning, 401))
    async def ollama_ps() -> dict[str, Any]:
        expires = (datetime.now(UTC) + _FOREVER).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"models": [{"name": ctx.model_name, "model": ctx.model_name,
                            "size": card().size, "digest": card().digest,
                            "details": _details(card()), "expires_at": expires, "size_vram": 0,
                            "context_length": ctx.max_model_len}]}

    @app.post("/api/show", responses=_responses(OllamaShow, 400, 401, 404, 413))
    async def ollama_show(req: OllamaShowRequest) -> dict[str, Any]:
        check_model(ctx, req.model or req.name)
        return _show(ctx, card())

    @app.post("/api/chat", response_model=None,
              responses=_responses(OllamaChatReply, *_GENERATE_ERRORS, streams=True))
    async def ollama_chat(req: OllamaChatRequest, raw: Request) -> Response:
        return await create_chat(ctx, req, raw)

    @app.post("/api/generate", response_model=None,
              responses=_responses(OllamaGenerateReply, *_GENERATE_ERRORS, streams=True))
    async def ollama_generate(req: OllamaGenerateRequest, raw: Request) -> Response:
        return await create_generate(ctx, req, raw)

    @app.post("/api/embed", responses=_responses(OllamaEmbedReply, *_GENERATE_ERRORS))
    async def ollama_embed(req: OllamaEmbedRequest, raw: Request) -> dict[str, Any]:
        return await create_embed(ctx, req, raw)

    @app.post("/api/embeddings", responses=_responses(OllamaEmbeddingReply, *_GENERATE_ERRORS))
    async def ollama_embeddings(req: OllamaEmbeddingsRequest, raw: Request) -> dict[str, Any]:
        return await create_embeddings(ctx, req, raw)

    async def model_store(raw: Request) -> None:
        raise bad_request(f"{raw.url.path} is not supported: nanoserve serves one model, "
                          f'"{ctx.model_name}", loaded when it started (nanoserve serve '
                          "--model); it has no model store to pull into or change")

    @app.post("/api/pull", include_in_schema=False, response_model=None)
    async def ollama_pull(raw: Request) -> Response:
        try:
            body = json.loads(await raw.body() or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object with the model to pull")
        asked = body.get("model") or body.get("name")
        if not isinstance(asked, str):
            raise bad_request("model is required", "model")
        if not ctx.answers_to(asked):
            raise APIError(404, f"cannot pull {asked!r} here: this server serves one model, "
                                f'"{ctx.model_name}", loaded when it started. To pull models '
                                "and serve them by name, run a router: nanoserve serve "
                                "--models-dir DIR (--allow-pull pulls what requests name); or "
                                "pull it with `nanoserve pull NAME` and serve it with "
                                "`nanoserve serve NAME`", "model")
        if body.get("stream") is False:
            return JSONResponse({"status": "success"})
        # one NDJSON line, ended: a client that reads lines (Codex) sees no end without it
        return Response(json.dumps({"status": "success"}) + "\n", media_type=NDJSON)

    for path, method in _STORE_ROUTES:
        app.add_api_route(path, model_store, methods=[method], include_in_schema=False,
                          name=f"ollama_store_{method.lower()}_{path}")


def _details(card: ModelCard) -> dict[str, Any]:
    details = {"parent_model": "", "format": "", "family": "", "families": None,
               "parameter_size": "", "quantization_level": ""}
    return {**details, **card.details}


def _show(ctx: ServerContext, card: ModelCard) -> dict[str, Any]:
    """/api/show's body: the template is the model's Jinja chat template (Ollama's is a Go
    template), the Modelfile one written to describe the served model."""
    template = ctx.chat_template or getattr(ctx.tokenizer, "chat_template", None) or ""
    parameters = "\n".join(f"{_PARAMETER_NAMES[key]:<30} {value}"
                           for key, value in ctx.generation_defaults.items()
                           if key in _PARAMETER_NAMES)
    modelfile = "\n".join(
        ["# Modelfile generated by nanoserve: the served model, its chat template (Jinja, "
         "not an Ollama Go template) and its sampling defaults", f"FROM {card.path}",
         f'TEMPLATE """{template}"""']
        + [f"PARAMETER {line}" for line in parameters.splitlines()]) + "\n"
    details = _details(card)
    info = dict(card.model_info)
    info.setdefault("general.architecture", details["family"])
    info.setdefault(f"{details['family']}.context_length", ctx.max_model_len)
    capabilities = ["completion", "embedding"]
    if ctx.tool_call_parser is not None:
        capabilities.append("tools")
    if ctx.reasoning_parser is not None:
        capabilities.append("thinking")
    if ctx.accepts_images:  # what Ollama's clients read before they offer an image upload
        capabilities.append("vision")
    return {"modelfile": modelfile, "parameters": parameters, "template": template,
            "details": details, "model_info": info, "capabilities": capabilities,
            "modified_at": card.modified_at}

"""Forwarding a request to its model's server: the model named in the body (or the `model`
query parameter), a lease on that model's server while the answer streams back as it comes,
and errors in OpenAI's shape, which the edge middleware turns into the shape of the API the
client called.

The body is read whole first (it is bounded by --max-request-body-bytes) to find its `model`;
the answer is relayed chunk by chunk, so streams (SSE, NDJSON) keep their timing. A client that
leaves closes the upstream request, which the model's server sees as a disconnect and aborts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from nanoserve.entrypoints.router.pool import (
    DEFAULT,
    KeepAlive,
    Lease,
    LoadError,
    ModelPool,
    TooManyWaitingError,
    UnknownModelError,
)
from nanoserve.entrypoints.serving.errors import error_body
from nanoserve.entrypoints.serving.model_names import ModelNames
from nanoserve.model.sources.names import parse_model_name

# hop-by-hop headers, and those the relay sets itself
_DROPPED_HEADERS = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "te",
                              "upgrade", "content-length", "proxy-authorization"})
OLLAMA_PREFIX = "/api/"


class RouteError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    """An error in OpenAI's shape; on another API's paths the edge middleware
    (entrypoints/edge/) reshapes it, as it does every other error of the app."""
    return JSONResponse(error_body(status, message, "model" if status == 404 else None),
                        status_code=status)


def body_fields(body: bytes) -> dict[str, Any]:
    """A request body's top-level fields, read once; {} for a body that is not a JSON object
    (the model's server answers a malformed body in its own words)."""
    if not body:
        return {}
    try:
        parsed = json.loads(body)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def auth_headers(request: Request) -> dict[str, str]:
    """The client's API-key headers, for the router's own calls to the models' servers."""
    return {k: v for k, v in request.headers.items() if k.lower() in ("authorization",
                                                                      "x-api-key")}


def asked_model(fields: dict[str, Any], query_model: str | None) -> str | None:
    """The name the request gives: its body's `model`, else the `model` query parameter."""
    return fields["model"] if isinstance(fields.get("model"), str) else query_model


def request_model(path: str, fields: dict[str, Any], query_model: str | None,
                  names: ModelNames) -> str:
    """The catalog name the request is for (any name the model answers to: model_names.py).
    A body without `model` is for the only model, if the directory holds one; otherwise a
    400 naming the models."""
    asked = asked_model(fields, query_model)
    if asked is None:
        if len(names.names) == 1:
            return names.names[0]
        if not names.names:
            raise RouteError(400, "model is required, and this server holds no model yet: "
                                  "pull one (`nanoserve pull NAME`, or Ollama's /api/pull)")
        raise RouteError(400, f"model is required: this server holds {len(names.names)} models "
                              f"({', '.join(sorted(names.names))}); name one in `model`")
    name = names.resolve(asked)
    if name is None:
        raise RouteError(404, _unknown_message(path, asked, names.names))
    return name


def _unknown_message(path: str, asked: str, names: tuple[str, ...]) -> str:
    """A 404 that says how to get the model: the pull commands, where `asked` is a name a pull
    takes (Ollama answers a chat for a model it lacks so, and never downloads one silently)."""
    here = ", ".join(sorted(names)) or "none yet"
    can_pull = parse_model_name(asked) is not None
    if path.startswith(OLLAMA_PREFIX):  # Ollama's own words, which its clients show
        how = f"`ollama pull {asked}` or `nanoserve pull {asked}`; " if can_pull else ""
        return (f'model "{asked}" not found, try pulling it first ({how}this server serves '
                f"the models of its --models-dir and those pulled: {here})")
    how = (f" Pull it first: `nanoserve pull {asked}`, or `ollama pull {asked}` against this "
           "server (a router started with --allow-pull pulls what it is asked for)."
           if can_pull else "")
    return f"The model `{asked}` does not exist.{how} Models here: {here}"


async def take_lease(pool: ModelPool, name: str, keep_alive: KeepAlive = DEFAULT) -> Lease:
    """The pool's lease, its errors as RouteErrors with the status the issue names."""
    try:
        return await pool.acquire(name, keep_alive)
    except UnknownModelError as e:
        raise RouteError(404, f"The model `{name}` does not exist.") from e
    except LoadError as e:
        raise RouteError(503, f"model {name!r} failed to load: {e}") from e
    except TooManyWaitingError as e:
        raise RouteError(429, f"too many requests wait for a model to load ({e}); retry "
                              "later") from e


class _RelayedResponse(StreamingResponse):
    """The upstream answer, chunk by chunk; `on_close` runs once it is over, however it
    ends (sent, client gone, upstream gone)."""

    def __init__(self, upstream: httpx.Response,
                 on_close: Callable[[], Awaitable[None]]) -> None:
        headers = {k: v for k, v in upstream.headers.items()
                   if k.lower() not in _DROPPED_HEADERS}
        super().__init__(self._relay(upstream), status_code=upstream.status_code,
                         headers=headers)
        self._upstream = upstream
        self._on_close = on_close
        self._closed = False

    @staticmethod
    async def _relay(upstream: httpx.Response) -> Any:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError:
            return  # the model's server went away mid-answer: the answer ends here

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._upstream.aclose()
            await self._on_close()


async def forward(request: Request, client: httpx.AsyncClient, pool: ModelPool,
                  lease: Lease, body: bytes) -> Response:
    """`request` sent on to the lease's server; the lease is given back when the answer ends."""
    url = lease.server.url + request.url.path
    if request.url.query:
        url += "?" + request.url.query
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS]
    started = time.monotonic()
    try:
        upstream = await client.send(client.build_request(request.method, url, headers=headers,
                                                          content=body), stream=True)
    except httpx.HTTPError as e:
        await pool.release(lease)
        return error_response(503, f"model {lease.entry.name!r} is not "
                              f"answering ({type(e).__name__} after "
                              f"{time.monotonic() - started:.1f} s); its next request "
                              "loads it again")
    return _RelayedResponse(upstream, lambda: pool.release(lease))

"""The chat page (`GET /`) and the live dashboard (`GET /dashboard`), served by the API server
itself, on its own port, from static files inside the package (`static/`: HTML, CSS and plain
JavaScript, with marked and DOMPurify vendored under `static/vendor/`; nothing to build, nothing
fetched from elsewhere).

The files are public, so a browser can load the page before it knows the API key. Everything the
page then asks of the server (`/web/defaults`, `/v1/chat/completions`, `/metrics`) goes through
the API-key middleware like any other client's call; on a 401 the page asks for the key, keeps it
in the browser's localStorage and sends it as `Authorization: Bearer`.

`/web/defaults` is behind the key too: it names the model and its settings, as `/v1/models` does
(keyed), and it is the page's first call, so a keyed server asks for the key as soon as the page
opens, not at the first message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from nanoserve.entrypoints.serving.chat_defaults import chat_defaults

STATIC_URL = "/web/static/"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
ASSETS = ("style.css", "common.js", "markdown.js", "stream.js", "attachments.js", "chat.js",
          "plot.js", "dashboard.js", "vendor/marked.umd.js", "vendor/purify.min.js")
# what the API-key middleware lets through without a key: the pages and their files, no data
PUBLIC_PATHS = frozenset({*PAGES, *(STATIC_URL + name for name in ASSETS)})
_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                ".js": "text/javascript; charset=utf-8"}
# The pages may load files from this server and talk to it, nothing else: no inline script, no
# `javascript:` URL, no image or request to another host, even if a bug let model output through
# unsanitized (DOMPurify is the first wall; this is the second).
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                           "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                           "form-action 'self'; frame-ancestors 'none'")
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
_PAGE_HEADERS = {**_HEADERS, "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                 "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}


@dataclass(frozen=True)
class WebPageInfo:
    """What the page learns about the server from `/web/defaults`."""

    model_name: str
    max_model_len: int
    reasoning_parser: str | None = None
    # the model's generation config as the API uses it ({} under --generation-config vllm)
    generation_config: dict[str, Any] = field(default_factory=dict)


def web_router() -> APIRouter:
    """The two pages and their files. Every file is read now, so a package missing one fails
    at start-up, not at the first visit."""
    files = {name: _read(name) for name in (*PAGES.values(), *ASSETS)}
    router = APIRouter(include_in_schema=False)  # the page's internals, not the OpenAI API

    def serve(name: str) -> Response:
        headers = _PAGE_HEADERS if name.endswith(".html") else _HEADERS
        media_type = _MEDIA_TYPES[name[name.rindex("."):]]
        return Response(files[name], media_type=media_type, headers=headers)

    @router.get("/")
    async def chat_page() -> Response:
        return serve(PAGES["/"])

    @router.get("/dashboard")
    async def dashboard_page() -> Response:
        return serve(PAGES["/dashboard"])

    @router.get(STATIC_URL + "{name:path}")
    async def static_file(name: str) -> Response:
        if name not in ASSETS:
            raise HTTPException(404, f"no file {STATIC_URL}{name}")
        return serve(name)

    return router


def web_defaults_router(info: Callable[[], WebPageInfo]) -> APIRouter:
    """`/web/defaults`: the served model's name and settings for the page, from `info()` at the
    first call. Every model's server answers it, with or without the pages: behind
    `--models-dir` the router serves the pages and each model's own server its defaults
    (`/web/defaults?model=NAME` reaches it)."""
    settings: dict[str, Any] = {}
    router = APIRouter(include_in_schema=False)

    @router.get("/web/defaults")
    async def web_defaults() -> dict[str, Any]:
        if not settings:
            served = info()
            defaults = chat_defaults(served.generation_config, served.max_model_len)
            settings.update({"model": served.model_name, "max_model_len": served.max_model_len,
                             "reasoning": served.reasoning_parser is not None,
                             "source": defaults.source, "sampling": defaults.sampling()})
        return settings

    return router


def _read(name: str) -> bytes:
    return (resources.files(__package__) / "static" / name).read_bytes()


def page_banner(host: str, port: int, model_name: str, scheme: str = "http") -> str:
    """The line `nanoserve serve` prints when it is ready: where to open the pages."""
    shown = "localhost" if host in ("", "0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    url = f"{scheme}://{shown}:{port}"
    return f"Chat with {model_name} at {url}/ (dashboard: {url}/dashboard)"

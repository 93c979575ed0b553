"""Ollama reads every request body as JSON whatever its Content-Type says, and its docs' own
`curl -d '{...}'` examples send curl's default, `application/x-www-form-urlencoded`, which
FastAPI would not parse as JSON. This ASGI middleware gives a body sent to `/api/` the JSON
type before the app reads it, so those requests work here as they do on Ollama."""

from __future__ import annotations

from typing import Any

from nanoserve.entrypoints.ollama.errors import is_ollama_path

_JSON = b"application/json"


class OllamaJsonBodies:
    """ASGI middleware: on `/api/` paths, the request's Content-Type is JSON (see the module)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and is_ollama_path(scope["path"]):
            headers = [(name, value) for name, value in scope.get("headers", ())
                       if name != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", _JSON)]}
        await self.app(scope, receive, send)

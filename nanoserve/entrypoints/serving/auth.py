"""API-key authentication as pure ASGI middleware (it keeps client-disconnect events intact).

Every route but /health needs `Authorization: Bearer <key>` or, as Anthropic's clients send
it, `x-api-key: <key>` (vLLM #18892 left /tokenize and others open), and takes any of the
server's keys (`--api-key` repeated, `--api-key-file`). Keys are compared as SHA-256 digests
with `secrets.compare_digest`, against every key whichever matches, so the time taken tells
neither the length of the guess nor which key it was near.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from nanoserve.entrypoints.serving.errors import error_body

PUBLIC_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """`public_paths` need no key: /health, and the web UI's static files when it is on."""

    def __init__(self, app: Any, api_keys: tuple[str, ...],
                 public_paths: frozenset[str] = PUBLIC_PATHS) -> None:
        assert api_keys, "the middleware is added only where keys are asked for"
        self.app = app
        self.digests = [hashlib.sha256(key.encode()).digest() for key in api_keys]
        self.public_paths = public_paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.public_paths or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, "missing or invalid API key: send "
                                          "'Authorization: Bearer <key>' or "
                                          "'x-api-key: <key>'")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", ()):
            key = None
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                key = token if scheme.lower() == "bearer" else None
            elif name == b"x-api-key":
                key = value.decode("latin-1")
            if key is not None and self._matches(key.strip()):
                return True
        return False

    def _matches(self, key: str) -> bool:
        digest = hashlib.sha256(key.encode()).digest()
        found = False
        for known in self.digests:  # every one compared: no early exit
            found |= secrets.compare_digest(digest, known)
        return found

"""Who sent a request: its tenant, the digest of the API key it presented.

A pure ASGI middleware reads the key (`Authorization: Bearer <key>` or `x-api-key: <key>`, as
the key check does) and sets a context variable for the request's handling; the engine client
copies it into each `EngineRequest`. Only draft proposers that learn across requests read it
(suffix decoding's past outputs, per tenant), so that one client's requests never change how
fast another's run. A request without a key is the tenant "" (all such requests together).
Only a digest travels: the key itself never leaves the API process.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from typing import Any

current_tenant: ContextVar[str] = ContextVar("current_tenant", default="")


def presented_key(headers: Any) -> str | None:
    """The API key among ASGI `headers` (name, value byte pairs), or None."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.decode("latin-1").strip()
    return None


def tenant_of(key: str | None) -> str:
    return "" if key is None else hashlib.sha256(key.encode()).hexdigest()[:32]


class TenantMiddleware:
    """Sets `current_tenant` for each HTTP request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = current_tenant.set(tenant_of(presented_key(scope.get("headers", ()))))
        try:
            await self.app(scope, receive, send)
        finally:
            current_tenant.reset(token)

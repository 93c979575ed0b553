"""Another API's error shape on its own paths, for every error the app can give there.

The server's errors are made in OpenAI's shape, by the exception handlers (`errors.py`), the
API-key check (`auth.py`) and the body limit (`limits.py`). Rather than teach each of them a
second shape, one ASGI middleware, outside all of them, rewrites an error answer (status 400 or
more) on the paths a wire format owns: its body goes through that format's `reshape`, the
status and the other headers stay. An exception no handler knows (a bug) would be answered by
Starlette's outermost error middleware, past this one, so it is answered here too (500, in the
format's shape) and then re-raised for the log. Anthropic's Messages (`anthropic/errors.py`)
and Ollama's API (`ollama/errors.py`) each add one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ErrorShape:
    """ASGI middleware: on the paths `owns` accepts, each error body rewritten by
    `reshape(body, status)`; an unhandled exception answered with `internal(message)`."""

    def __init__(self, app: Any, owns: Callable[[str], bool],
                 reshape: Callable[[bytes, int], bytes],
                 internal: Callable[[str], bytes]) -> None:
        self.app = app
        self.owns = owns
        self.reshape = reshape
        self.internal = internal

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.owns(scope["path"]):
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] | None = None  # an error's response start, until its body is read
        chunks: list[bytes] = []
        has_started = False

        async def reshaping_send(message: dict[str, Any]) -> None:
            nonlocal held, has_started
            if message["type"] == "http.response.start":
                has_started = True
                if message["status"] >= 400:
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                start, held = held, None
                await _send_json(send, start, self.reshape(b"".join(chunks), start["status"]))
                return
            await send(message)

        try:
            await self.app(scope, receive, reshaping_send)
        except Exception as e:
            if not has_started:
                await _send_json(send, {"status": 500, "headers": []},
                                 self.internal(f"internal error: {type(e).__name__}"))
            raise


async def _send_json(send: Any, start: dict[str, Any], body: bytes) -> None:
    headers = [(name, value) for name, value in start.get("headers", [])
               if name.lower() not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": start["status"], "headers": headers})
    await send({"type": "http.response.body", "body": body})

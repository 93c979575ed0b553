"""A real HTTP server on loopback that answers every POST with a handler's reply: what the
benchmarks' load client is tested against (recorded streams, errors, slow chunks)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """`handler` behind every path on a free port until the block ends; yields the base URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def replay(request: web.Request, chunks: Sequence[bytes],
                 on_end: Callable[[], None] | None = None) -> web.StreamResponse:
    """Stream `chunks` as an SSE response, each written (and flushed) on its own; `on_end` is
    called before the last one."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for i, chunk in enumerate(chunks):
        await asyncio.sleep(0)  # let other requests run between chunks
        if i == len(chunks) - 1 and on_end is not None:
            on_end()
        await response.write(chunk)
    await response.write_eof()
    return response


def replaying(chunks: Sequence[bytes]) -> Handler:
    """A handler that answers every request with `replay(chunks)`."""
    async def handler(request: web.Request) -> web.StreamResponse:
        return await replay(request, chunks)

    return handler

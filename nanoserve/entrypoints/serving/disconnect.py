"""Waiting for a non-streamed answer while watching the client: the request's final output,
or, if the client goes away first, its work cancelled (which aborts its engine requests)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

from nanoserve.outputs import RequestOutput

T = TypeVar("T")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client goes away first, cancel it (which aborts its engine
    requests) and answer nothing."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise asyncio.CancelledError("client disconnected")
    finally:
        watcher.cancel()


async def collect(generator: Any) -> RequestOutput:
    """The final RequestOutput of a FINAL_ONLY request."""
    final = None
    async for output in generator:
        final = output
    assert final is not None
    return final

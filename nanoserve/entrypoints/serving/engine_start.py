"""An API server's wait for its engine cores, and a failed start told in one line.

Whatever stops a start (the model's files, its architecture, the memory; in the engine core
or in this process's own tokenizer load) reaches the terminal as one line on stderr naming the
cause and the fix, `nanoserve serve: error: ...`, and the server exits 1. The traceback is
logged at `--log-level debug` only: a user who mistyped a path reads one line, not thirty.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

from nanoserve.engine.core_client import EngineCoreClient
from nanoserve.engine.start_failure import start_failure_reason
from nanoserve.protocol import EngineDead, EngineReady, EngineStartFailed

logger = logging.getLogger("nanoserve")


class EngineStartError(RuntimeError):
    """The server cannot start: `reason` is the line a user reads, `detail` the traceback."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail

    @classmethod
    def of(cls, error: BaseException) -> EngineStartError:
        """A failure of this process's own start (its tokenizer, say), told the same way."""
        import traceback

        return cls(start_failure_reason(error), "".join(traceback.format_exception(error)))


async def wait_for_engines(client: EngineCoreClient, alive: Callable[[], bool],
                           stopping: Callable[[], bool], timeout_s: float) -> EngineReady | None:
    """Engine 0's EngineReady once every engine core has sent its own; None if `stopping()`
    turned true meanwhile (a stop signal during the start). Raises EngineStartError if one
    failed to start, exited, or `timeout_s` passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    ready: dict[int, EngineReady] = {}
    while loop.time() < deadline:
        try:  # after an engine core's exit, what it sent before it went
            message = await asyncio.wait_for(client.recv(), timeout=0.5 if alive() else 0.1)
        except TimeoutError:
            if stopping():
                return None
            if not alive():
                raise EngineStartError(
                    "the engine core exited while loading the model (killed, perhaps by the "
                    "kernel's out-of-memory killer: lower --kv-cache-memory or use a smaller "
                    "model)") from None
            continue
        if isinstance(message, EngineReady):
            ready[message.engine_index] = message
            if len(ready) == client.num_engines:
                return ready[0]
        elif isinstance(message, EngineStartFailed):
            raise EngineStartError(message.reason, message.traceback)
        elif isinstance(message, EngineDead):
            raise EngineStartError(f"engine core {message.engine_index} failed as it started",
                                   message.message)
    raise EngineStartError(f"the engine cores did not start within {timeout_s:.0f} s")


def print_start_failure(error: EngineStartError) -> None:
    """The one line on stderr (printed, not logged: it shows at any --log-level); the
    traceback behind it at debug."""
    if error.detail:
        logger.debug("why the server could not start:\n%s", error.detail)
    print(f"nanoserve serve: error: {error.reason}", file=sys.stderr, flush=True)

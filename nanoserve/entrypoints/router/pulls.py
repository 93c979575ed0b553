"""The router's pulls: a model fetched by name (model/sources/fetch.py's `pull_model`) in a
thread, so the event loop, and every other model's requests, never wait for a download.

One pull per name at a time: Ollama's `/api/pull` streams and the requests that `--allow-pull`
holds until their model is here join it, each seeing its events from where it stands. Its
progress goes to the router's log and to `/v1/models` (`status`); when every client that asked
for it has gone, it stops at its next event (its partial blob kept, so a later pull resumes).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from nanoserve.model.sources.fetch import pull_model
from nanoserve.model.sources.progress import Progress
from nanoserve.model.sources.store import PulledModel, canonical_name

logger = logging.getLogger("nanoserve.router")
_SEND_EVERY_S = 0.1  # a transfer's progress to the streams at most this often (and its end)
_LOG_EVERY_S = 5.0  # and in the log


class PullCancelled(Exception):
    """Every client that asked for a pull has gone (raised by its progress sink)."""


@dataclass
class _Pull:
    name: str  # as it is recorded: canonical_name()
    task: asyncio.Future[PulledModel] | None = None
    latest: Progress | None = None
    listeners: set[asyncio.Queue[Progress | None]] = field(default_factory=set)
    num_waiting: int = 0  # clients that wait for it: streams, held requests
    is_cancelled: bool = False  # read by the pulling thread at each event
    sent: Progress | None = None  # the last event passed on to the streams, and when
    sent_at: float = 0.0
    logged: Progress | None = None  # the last event logged, and when
    logged_at: float = 0.0


class Pulls:
    """The pulls in progress (see the module). `on_pulled` is called, on the event loop, with
    each model pulled, before anyone waiting for it hears so."""

    def __init__(self, on_pulled: Callable[[PulledModel], None],
                 token: str | None = None) -> None:
        self.on_pulled = on_pulled
        self.token = token  # --hf-token, for gated hub repositories
        self._pulls: dict[str, _Pull] = {}

    def status(self) -> dict[str, dict[str, Any]]:
        """Name → `/v1/models`' status of each model being pulled: its last event, and how
        many clients wait for it (0: it stops at its next event)."""
        return {name: {"value": "pulling",
                       "progress": {} if pull.latest is None else pull.latest.to_json(),
                       "waiting": pull.num_waiting}
                for name, pull in self._pulls.items()}

    async def pull(self, name: str) -> PulledModel:
        """`name` pulled (or joined, if it is being pulled); raises ModelSourceError."""
        for _ in range(2):  # once more if it ended cancelled just as we joined it
            pull = self._join(name)
            try:
                assert pull.task is not None
                return await asyncio.shield(pull.task)  # our leaving must not cancel it
            except PullCancelled:
                continue
            finally:
                self._leave(pull)
        raise PullCancelled(name)

    async def events(self, name: str) -> AsyncGenerator[Progress, None]:
        """`name`'s pull's events from where it stands, the last one `success`; raises
        ModelSourceError if it fails. A client that stops iterating leaves the pull."""
        for _ in range(2):  # as pull()
            pull = self._join(name)
            queue: asyncio.Queue[Progress | None] = asyncio.Queue()
            pull.listeners.add(queue)
            try:
                if pull.latest is not None:
                    yield pull.latest
                while (event := await queue.get()) is not None:
                    yield event
                assert pull.task is not None
                await asyncio.shield(pull.task)  # its error, if it failed
                return
            except PullCancelled:
                continue
            finally:
                pull.listeners.discard(queue)
                self._leave(pull)
        raise PullCancelled(name)

    def _join(self, name: str) -> _Pull:
        key = canonical_name(name)
        pull = self._pulls.get(key)
        if pull is None:
            pull = self._pulls[key] = _Pull(key)
            pull.task = self._start(pull)
            pull.task.add_done_callback(lambda task: self._ended(pull, task))
            logger.info("pulling %s", key)
        pull.num_waiting += 1
        pull.is_cancelled = False
        return pull

    def _leave(self, pull: _Pull) -> None:
        pull.num_waiting -= 1
        if pull.num_waiting == 0 and pull.task is not None and not pull.task.done():
            logger.info("pulling %s: every client left; stopped (a later pull resumes it)",
                        pull.name)
            pull.is_cancelled = True

    def close(self) -> None:
        """Every pull stopped at its next event (the router is stopping)."""
        for pull in self._pulls.values():
            pull.is_cancelled = True

    def _start(self, pull: _Pull) -> asyncio.Future[PulledModel]:
        """The pull in a daemon thread of its own (not the loop's executor, which the loop's
        end waits for: a router stopped during a pull of gigabytes must not wait for it); its
        events and its end handed to the loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PulledModel] = loop.create_future()

        def sink(event: Progress) -> None:
            if pull.is_cancelled:
                raise PullCancelled(pull.name)
            loop.call_soon_threadsafe(self._event, pull, event)

        def run() -> None:
            try:
                result = pull_model(pull.name, token=self.token, progress=sink)
            except Exception as e:  # every failure is the pull's answer
                settle = functools.partial(_fail, future, e)
            else:
                settle = functools.partial(_succeed, future, result)
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
                loop.call_soon_threadsafe(settle)

        threading.Thread(target=run, name=f"pull {pull.name}", daemon=True).start()
        return future

    def _event(self, pull: _Pull, event: Progress) -> None:
        """One event of the pull (one a MiB of a transfer): kept for /v1/models, passed on to
        the streams at most every _SEND_EVERY_S of a file, logged every _LOG_EVERY_S."""
        pull.latest = event
        now = time.monotonic()
        if _is_news(pull.sent, event, now - pull.sent_at, _SEND_EVERY_S):
            pull.sent, pull.sent_at = event, now
            for queue in pull.listeners:
                queue.put_nowait(event)
        if _is_news(pull.logged, event, now - pull.logged_at, _LOG_EVERY_S):
            pull.logged, pull.logged_at = event, now
            is_transfer = event.total is not None and event.completed is not None
            logger.info("pulling %s: %s%s", pull.name, event.status,
                        f" {event.completed}/{event.total} bytes" if is_transfer else "")

    def _ended(self, pull: _Pull, task: asyncio.Future[PulledModel]) -> None:
        del self._pulls[pull.name]
        if not task.cancelled() and task.exception() is None:
            self.on_pulled(task.result())
        elif not task.cancelled() and not isinstance(task.exception(), PullCancelled):
            logger.error("pulling %s failed: %s", pull.name, task.exception())
        for queue in pull.listeners:
            queue.put_nowait(None)


def _is_news(before: Progress | None, event: Progress, elapsed: float, every: float) -> bool:
    """Whether `event` is worth passing on after `before`: another status or file, a file's
    end, or `every` seconds since `before`."""
    return (before is None or event.status != before.status or event.digest != before.digest
            or event.completed == event.total or elapsed >= every)


def _succeed(future: asyncio.Future[PulledModel], result: PulledModel) -> None:
    if not future.done():
        future.set_result(result)


def _fail(future: asyncio.Future[PulledModel], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)

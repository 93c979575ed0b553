"""Which models are loaded, and when one loads or unloads: the router's only state.

A request takes a lease on its model (`acquire`) and gives it back when its answer has gone out
(`release`). The rules, Ollama's and llama-server's router mode's:

- A request for a loaded model goes straight through; a model another request is loading is
  waited for; a model that is not loaded is loaded, if fewer than `models_max` are.
- Past `models_max`, the least recently used loaded model is marked to unload: it takes no new
  request, finishes those it runs (a running stream is never cut for another model's load), then
  its server stops. Requests waiting for a model that needs loading get slots in their order of
  arrival, so alternating requests all complete and none waits forever.
- A model idle for its keep-alive (the request's `keep_alive`, else `--keep-alive`; None keeps
  it) unloads; a keep-alive of 0 unloads it once its last request ends.
- A load that fails answers every request that waited for it with the reason (503); the next
  request tries again. A model whose server dies is unloaded; the next request reloads it.
- Models come and go while the router runs (pulled, deleted: `add`, `remove`); a removed model
  takes no new request, finishes those it runs, then leaves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from nanoserve.entrypoints.router.model_server import LoadError, ModelServer
from nanoserve.entrypoints.serving.model_names import ModelNames

__all__ = ["DEFAULT", "KeepAlive", "Lease", "LoadError", "ModelEntry", "ModelPool",
           "ModelState", "TooManyWaitingError", "UnknownModelError"]

logger = logging.getLogger("nanoserve.router")
_REAP_INTERVAL_S = 0.25


class ModelState(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"


class UnknownModelError(LookupError):
    pass


class TooManyWaitingError(RuntimeError):
    pass


class _Default:
    """The keep-alive a request did not set: the router's --keep-alive."""


DEFAULT = _Default()
KeepAlive = float | None | _Default  # seconds; None keeps the model loaded


@dataclass
class ModelEntry:
    name: str
    path: Path
    state: ModelState = ModelState.UNLOADED
    server: ModelServer | None = None
    in_flight: int = 0
    last_used: float = 0.0  # time.monotonic() of its last lease
    expires_at: float | None = None  # time.time() when it unloads if still idle; None: never
    draining: bool = False  # to unload: it takes no new request
    failure: str | None = None  # why its last load failed
    loads_begun: int = 0
    removed: bool = False  # deleted: it takes no request and leaves once unloaded
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


@dataclass(frozen=True)
class Lease:
    entry: ModelEntry
    server: ModelServer
    keep_alive: KeepAlive


@dataclass
class _Waiter:
    entry: ModelEntry


class ModelPool:
    def __init__(self, models: dict[str, Path], child_args: list[str], models_max: int,
                 keep_alive: float | None, load_timeout: float, max_waiting: int,
                 stop_grace: float) -> None:
        if models_max < 1:
            raise ValueError(f"--models-max must be at least 1, got {models_max}")
        self.entries = {name: ModelEntry(name, path) for name, path in models.items()}
        self.names = ModelNames(models)  # what each model answers to, as its server does
        self.child_args = child_args
        self.models_max = models_max
        self.keep_alive = keep_alive
        self.load_timeout = load_timeout
        self.max_waiting = max_waiting
        self.stop_grace = stop_grace
        self._changed = asyncio.Condition()
        self._waiting: list[_Waiter] = []  # requests whose model is not ready, oldest first
        self._reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_idle())

    async def acquire(self, name: str, keep_alive: KeepAlive = DEFAULT) -> Lease:
        """A lease on `name`'s server, once it is loaded. UnknownModelError, LoadError (its
        load failed), TooManyWaitingError (more requests wait for loads than allowed)."""
        entry = self.entries.get(name)
        if entry is None or entry.removed:
            raise UnknownModelError(name)
        async with self._changed:
            if entry.state is ModelState.LOADED and not entry.draining:
                return self._lease(entry, keep_alive)
            if len(self._waiting) >= self.max_waiting:
                raise TooManyWaitingError(
                    f"{len(self._waiting)} requests already wait for models to load")
            waiter = _Waiter(entry)
            self._waiting.append(waiter)
            loads_seen = entry.loads_begun
            try:
                while True:
                    if entry.removed:
                        raise UnknownModelError(name)
                    if entry.state is ModelState.LOADED and not entry.draining:
                        return self._lease(entry, keep_alive)
                    if entry.state is ModelState.UNLOADED:
                        if entry.failure is not None and entry.loads_begun > loads_seen:
                            raise LoadError(entry.failure)
                        if self._first_to_load(waiter):
                            self._make_room_or_load(entry)
                    await self._changed.wait()
            finally:
                self._waiting.remove(waiter)
                self._changed.notify_all()  # the next waiter may be first now

    async def release(self, lease: Lease) -> None:
        async with self._changed:
            entry = lease.entry
            if entry.server is not lease.server:  # a server that has died since
                return
            entry.in_flight -= 1
            entry.last_used = time.monotonic()
            if entry.in_flight == 0:
                keep = self.keep_alive if isinstance(lease.keep_alive, _Default) \
                    else lease.keep_alive
                if entry.draining or keep == 0:
                    self._begin_unload(entry)
                else:
                    entry.expires_at = None if keep is None or keep < 0 else time.time() + keep
            self._changed.notify_all()

    async def unload(self, name: str) -> None:
        """Unload `name` once its running requests end; returns when its server is gone."""
        entry = self.entries.get(name)
        if entry is None:
            raise UnknownModelError(name)
        async with self._changed:
            if entry.state is ModelState.LOADED:
                entry.draining = True
                if entry.in_flight == 0:
                    self._begin_unload(entry)
            await self._changed.wait_for(lambda: entry.state in (ModelState.UNLOADED,
                                                                  ModelState.LOADED)
                                         and not entry.draining)

    def add(self, name: str, path: Path) -> None:
        """Serve `name` from `path` from now on (a model pulled while the router runs). A name
        already served keeps its entry; its next load reads `path` (a loaded server keeps the
        file it opened)."""
        entry = self.entries.get(name)
        if entry is None:
            self.entries[name] = ModelEntry(name, path)
            self._names_changed()
        elif not entry.removed:
            entry.path = path

    async def remove(self, name: str) -> None:
        """Stop serving `name`: no new request reaches it; returns once its running requests
        have ended and its server is gone (Ollama's delete of a loaded model)."""
        entry = self.entries.get(name)
        if entry is None or entry.removed:
            raise UnknownModelError(name)
        async with self._changed:
            entry.removed = True
            if entry.state is ModelState.LOADED:
                entry.draining = True
                if entry.in_flight == 0:
                    self._begin_unload(entry)
            self._changed.notify_all()  # requests that wait for it: a 404 now
            await self._changed.wait_for(lambda: entry.state is ModelState.UNLOADED)
            del self.entries[name]
            self._names_changed()

    def _names_changed(self) -> None:
        self.names = ModelNames({name: e.path for name, e in self.entries.items()})

    async def close(self) -> None:
        """Stop every model's server (the router is stopping)."""
        if self._reaper is not None:
            self._reaper.cancel()
        servers = [e.server for e in self.entries.values() if e.server is not None]
        for entry in self.entries.values():
            for task in list(entry.tasks):
                task.cancel()
        await asyncio.gather(*(s.stop(self.stop_grace) for s in servers),
                             return_exceptions=True)

    def kill_all(self) -> None:
        """Every model's server killed now, its process group with it (a second stop)."""
        for entry in self.entries.values():
            if entry.server is not None:
                entry.server.kill()

    # --- under the lock ---------------------------------------------------------------------

    def _lease(self, entry: ModelEntry, keep_alive: KeepAlive) -> Lease:
        assert entry.server is not None
        entry.in_flight += 1
        entry.last_used = time.monotonic()
        entry.expires_at = None
        return Lease(entry, entry.server, keep_alive)

    def _first_to_load(self, waiter: _Waiter) -> bool:
        """Whether `waiter` is the oldest of the requests whose model is not loaded."""
        for other in self._waiting:
            if other.entry.state is ModelState.UNLOADED:
                return other is waiter
        return False

    def _make_room_or_load(self, entry: ModelEntry) -> None:
        held = [e for e in self.entries.values() if e.state is not ModelState.UNLOADED]
        if len(held) < self.models_max:
            self._begin_load(entry)
            return
        if any(e.draining or e.state is ModelState.UNLOADING for e in held):
            return  # a slot is already on its way
        idle_first = [e for e in held if e.state is ModelState.LOADED]
        if not idle_first:
            return  # every slot is loading: wait
        victim = min(idle_first, key=lambda e: e.last_used)
        logger.info("unloading %s to make room for %s (--models-max %d)", victim.name,
                    entry.name, self.models_max)
        victim.draining = True
        if victim.in_flight == 0:
            self._begin_unload(victim)

    def _begin_load(self, entry: ModelEntry) -> None:
        entry.state = ModelState.LOADING
        entry.failure = None
        entry.loads_begun += 1
        server = ModelServer(entry.name, entry.path, self.child_args)
        entry.server = server
        self._spawn(entry, self._load(entry, server))

    def _begin_unload(self, entry: ModelEntry) -> None:
        entry.state = ModelState.UNLOADING
        entry.draining = False
        server = entry.server
        assert server is not None
        self._spawn(entry, self._unload(entry, server))

    def _spawn(self, entry: ModelEntry, work: object) -> None:
        task: asyncio.Task[None] = asyncio.create_task(work)  # type: ignore[arg-type]
        entry.tasks.add(task)
        task.add_done_callback(entry.tasks.discard)

    # --- tasks ------------------------------------------------------------------------------

    async def _load(self, entry: ModelEntry, server: ModelServer) -> None:
        logger.info("loading %s (%s)", entry.name, entry.path)
        started = time.monotonic()
        try:
            await server.start(self.load_timeout)
        except (LoadError, OSError) as e:
            logger.error("model %s failed to load: %s", entry.name, e)
            await server.stop(grace=0.0)
            async with self._changed:
                entry.state = ModelState.UNLOADED
                entry.server = None
                entry.failure = str(e)
                self._changed.notify_all()
            return
        logger.info("loaded %s in %.1f s", entry.name, time.monotonic() - started)
        async with self._changed:
            entry.state = ModelState.LOADED
            entry.in_flight = 0
            entry.last_used = time.monotonic()
            keep = self.keep_alive
            entry.expires_at = None if keep is None or keep < 0 else time.time() + keep
            if entry.removed:  # deleted while it loaded
                self._begin_unload(entry)
            self._changed.notify_all()
        self._spawn(entry, self._watch(entry, server))

    async def _watch(self, entry: ModelEntry, server: ModelServer) -> None:
        status = await server.exited()
        if server.stopping:
            return
        logger.error("the server of model %s exited with status %s; it will load again on "
                     "its next request", entry.name, status)
        await server.stop(grace=0.0)  # anything left in its process group
        async with self._changed:
            if entry.server is server:
                entry.state = ModelState.UNLOADED
                entry.server = None
                entry.draining = False
                entry.in_flight = 0
            self._changed.notify_all()

    async def _unload(self, entry: ModelEntry, server: ModelServer) -> None:
        logger.info("unloading %s", entry.name)
        await server.stop(self.stop_grace)
        async with self._changed:
            if entry.server is server:
                entry.state = ModelState.UNLOADED
                entry.server = None
                entry.expires_at = None
            self._changed.notify_all()

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(_REAP_INTERVAL_S)
            async with self._changed:
                now = time.time()
                for entry in self.entries.values():
                    if (entry.state is ModelState.LOADED and entry.in_flight == 0
                            and not entry.draining and entry.expires_at is not None
                            and now >= entry.expires_at):
                        logger.info("%s was idle for its keep-alive", entry.name)
                        self._begin_unload(entry)
                        self._changed.notify_all()

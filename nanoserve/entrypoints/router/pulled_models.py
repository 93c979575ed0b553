"""The models a router serves by the name they were pulled as, beside its directory's: the
store's (model/sources/store.py), read again when a request names a model the router does not
know, since `nanoserve pull`, Ollama's `/api/pull` or another router may add one at any time;
with `--allow-pull`, a name nobody has pulled yet is pulled then (pulls.py), its request held
until the model is here.

A directory's model keeps its name: a pulled model of the same name is not served. A model
removed from the store elsewhere (`nanoserve rm`) leaves once it is unloaded; a loaded one keeps
serving the file it opened until then.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from nanoserve.entrypoints.router.forward import RouteError, asked_model, request_model
from nanoserve.entrypoints.router.pool import ModelPool, ModelState, UnknownModelError
from nanoserve.entrypoints.router.pulls import Pulls
from nanoserve.model.sources.errors import ModelNotFoundError, ModelSourceError
from nanoserve.model.sources.names import parse_model_name
from nanoserve.model.sources.store import PulledModel, list_pulled, remove_pulled


class PulledModels:
    """The pool's pulled models (see the module); `records` holds each one's store record, by
    its name in the pool."""

    def __init__(self, pool: ModelPool, allow_pull: bool, token: str | None = None) -> None:
        self.pool = pool
        self.allow_pull = allow_pull
        self.pulls = Pulls(self.serve, token)
        self.records: dict[str, PulledModel] = {}

    async def refresh(self) -> None:
        """The store read again: each pulled model served; those no longer in it (or whose
        files are gone) forgotten, once unloaded."""
        found = {m.name: m for m in await asyncio.to_thread(list_pulled) if m.path.exists()}
        for model in found.values():
            self.serve(model)
        for name in [n for n in self.records if n not in found]:
            entry = self.pool.entries.get(name)
            if entry is None or entry.state is ModelState.UNLOADED:
                self.records.pop(name, None)
                if entry is not None and not entry.removed:
                    with contextlib.suppress(UnknownModelError):  # another refresh's
                        await self.pool.remove(name)

    async def find(self, path: str, fields: dict[str, Any], query_model: str | None) -> str:
        """The pool's name of the model a request names: known, found in the store, or with
        --allow-pull pulled now. A RouteError otherwise: 404 with how to pull it (forward.py),
        or the pull's failure (404 for a name the registry or hub lacks, else 502)."""
        asked = asked_model(fields, query_model)
        if asked is not None and not self._is_served(asked):
            await self.refresh()
            if not self._is_served(asked) and self.allow_pull \
                    and parse_model_name(asked) is not None:
                try:
                    self.serve(await self.pulls.pull(asked))
                except ModelSourceError as e:
                    raise RouteError(404 if isinstance(e, ModelNotFoundError) else 502,
                                     str(e)) from e
        return request_model(path, fields, query_model, self.pool.names)

    async def delete(self, asked: str) -> bool:
        """Ollama's delete: `asked`'s model unloaded (once its running requests end) and
        removed from the store. False if no pulled model has that name; a ValueError for a
        directory's model (its file is the user's)."""
        await self.refresh()
        name = self.pool.names.resolve(asked)
        if name is not None and name not in self.records:
            raise ValueError(f"{name!r} is a model of --models-dir: nanoserve deletes pulled "
                             "models only (remove its file to stop serving it)")
        record = None if name is None else self.records.get(name)
        if name is None or record is None:
            return False
        # the store first: from now on nobody finds it; a loaded server keeps its open file
        removed = await asyncio.to_thread(remove_pulled, record.name)
        self.records.pop(name, None)
        with contextlib.suppress(UnknownModelError):  # another delete got there first
            await self.pool.remove(name)
        return removed

    def _is_served(self, asked: str) -> bool:
        name = self.pool.names.resolve(asked)
        return name is not None and (name not in self.records
                                     or self.records[name].path.exists())

    def serve(self, model: PulledModel) -> None:
        """Serve `model` by its name, unless a directory's model has that name."""
        if model.name in self.pool.entries and model.name not in self.records:
            return  # the directory's model of that name wins
        self.records[model.name] = model
        self.pool.add(model.name, model.path)

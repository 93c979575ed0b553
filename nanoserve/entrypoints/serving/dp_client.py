"""DPEngineClient: an API server's view of its data-parallel engine cores.

Each new request goes to one engine core, picked by DPRouter (engine/dp_router.py) from its
prompt's block hashes (the engines' own hash and block size) and each engine's load: the
larger of what this API server has in flight there and the engine's latest `num_waiting +
num_running` (vLLM's DP load balancing signal). All samples of an `n > 1` request go to that one
engine together: they share its prefill there (`prefill_leader`). The client remembers which
engine holds each engine request until it finishes, so an abort goes where the request runs
(vLLM's `reqs_in_flight`), and keeps every engine's latest SchedulerStats (the `engine`
label of /metrics). With one engine core nothing is hashed: everything goes to engine 0.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence

from nanoserve.engine.core_client import EngineCoreClient
from nanoserve.engine.dp_router import (
    DPRouter,
    RoutingConfig,
    engine_load,
    prompt_block_hashes,
)
from nanoserve.protocol import (
    AbortRequests,
    EngineMessage,
    EngineOutputs,
    EngineRequest,
    ImageInput,
    RequestError,
    SchedulerStats,
)

logger = logging.getLogger("nanoserve")


class DPEngineClient:
    """Routes requests over the engine cores, sends aborts where each request runs, and
    keeps each engine's latest stats."""

    def __init__(self, client: EngineCoreClient, routing: RoutingConfig,
                 block_size: int) -> None:
        self.client = client
        self.router = DPRouter(client.num_engines, routing)
        self.block_size = block_size  # the engines' (EngineReady.block_size)
        self.engine_of: dict[str, int] = {}  # engine request id -> engine core
        self.num_in_flight = [0] * client.num_engines  # engine requests, per engine
        self.engine_stats = [SchedulerStats() for _ in range(client.num_engines)]

    @property
    def client_index(self) -> int:
        return self.client.client_index

    @property
    def num_engines(self) -> int:
        return self.client.num_engines

    def place(self, prompt_token_ids: list[int], cache_salt: str | None = None,
              images: Sequence[ImageInput] = ()) -> int:
        """The engine core for a new request with this prompt (its prefix-cache salt and its
        images hashed into the blocks as the engine's cache hashes them)."""
        if self.num_engines == 1:
            return 0
        loads = [engine_load(self.num_in_flight[k], s.num_waiting, s.num_running)
                 for k, s in enumerate(self.engine_stats)]
        hashes = (prompt_block_hashes(prompt_token_ids, self.block_size, cache_salt, images)
                  if self.router.config.policy == "cache_aware" else [])
        return self.router.route(hashes, loads)

    async def add(self, requests: list[EngineRequest]) -> int:
        """Send one API request's engine requests (its samples) to one engine core: which."""
        first = requests[0]
        engine = self.place(first.prompt_token_ids, first.params.cache_salt, first.images)
        for request in requests:
            self.engine_of[request.request_id] = engine
            self.num_in_flight[engine] += 1
        for request in requests:
            await self.client.send(request, engine)
        return engine

    async def abort(self, engine_request_ids: Iterable[str]) -> None:
        for engine, ids in self._take(engine_request_ids).items():
            await self.client.send(AbortRequests(ids), engine)

    def abort_nowait(self, engine_request_ids: Iterable[str]) -> None:
        """`abort` for paths that cannot await; raises what the socket raises (zmq.Again
        when its queue is full). Requests already finished are not sent."""
        for engine, ids in self._take(engine_request_ids).items():
            self.client.send_nowait(AbortRequests(ids), engine)

    async def recv(self) -> EngineMessage:
        """The next message of any engine core, after noting its stats and finishes."""
        message = await self.client.recv()
        if isinstance(message, EngineOutputs):
            if 0 <= message.engine_index < self.num_engines:
                self.engine_stats[message.engine_index] = message.stats
            for out in message.outputs:
                if out.finish_reason is not None:
                    self._forget(out.request_id)
        elif isinstance(message, RequestError):
            self._forget(message.request_id)
        return message

    def close(self) -> None:
        self.client.close()

    def _forget(self, request_id: str) -> int | None:
        engine = self.engine_of.pop(request_id, None)
        if engine is not None:
            self.num_in_flight[engine] -= 1
        return engine

    def _take(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """The requests still in flight among `request_ids`, by engine; forgotten here."""
        by_engine: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            engine = self._forget(request_id)
            if engine is not None:
                by_engine[engine].append(request_id)
        return by_engine

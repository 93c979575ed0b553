"""What a router in front of replicas (`vllm-router`, read against its 0.1.17 source) asks a
replica: the token ids a request would prefill, to hash against the blocks each replica holds,
and who the replica is, and where it publishes its KV-cache events (`/kv_event_sources`): with
these two, `vllm-router --policy kv_aware --worker-urls ...` finds each replica's publisher
itself, without `--kv-event-source` flags.

`vllm-router --policy kv_aware` asks every worker for the ids of each incoming request within
a 1 s budget, and they must be exactly the ids the worker prefills; so the render routes run
the real endpoints' preparation (`prepare_chat`, `prepare_completion`: template, tokenizer,
checks, the same 400s) and stop before the engine. They skip only the checks of what is in
flight (429, 503): a render admits nothing. vLLM answers the same paths.
"""

from __future__ import annotations

import socket
import uuid
from typing import Any

from fastapi import FastAPI

import nanoserve
from nanoserve.config import KVEventsConfig
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.entrypoints.openai.response_models import (
    CompletionRenderResponse,
    KVEventSourcesResponse,
    RenderResponse,
    ServerInfoResponse,
)
from nanoserve.entrypoints.openai.serving_chat import render_chat
from nanoserve.entrypoints.openai.serving_completion import render_completion
from nanoserve.entrypoints.serving.errors import APIError
from nanoserve.entrypoints.serving.openapi import responses
from nanoserve.entrypoints.serving.server_context import ServerContext

RENDER_ERRORS = (400, 401, 404, 413)


def instance_id(port: int, engine_pid: int) -> str:
    """One id per engine start, the same in every API process of the server (they share the
    engine, its pid and the port); opaque, so it names no host or process."""
    return uuid.uuid5(uuid.NAMESPACE_URL,
                      f"nanoserve://{socket.gethostname()}:{port}/{engine_pid}").hex


def kv_event_sources(config: KVEventsConfig, num_engines: int = 1) -> dict[str, dict[str, Any]]:
    """/kv_event_sources' body: one entry per data-parallel engine core, keyed by its rank as a
    string, in the shape vllm-router's discovery reads (vLLM's KVEventsConfig fields, and the
    wire format's name and version: "zmq", "msgpack", 1). Empty when no events are published.
    Engine k publishes on the configured ports plus k (vLLM's `offset_endpoint_port`); a bind
    address such as `tcp://*:5557` is the router's to resolve to this host."""
    if not config.is_publishing:
        return {}
    engines = [config.for_engine(rank) for rank in range(num_engines)]
    return {str(rank): {"endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint,
                        "topic": engine.topic, "hwm": engine.hwm,
                        "buffer_steps": engine.buffer_steps, "publisher": "zmq",
                        "encoding": "msgpack", "schema_version": 1,
                        "enable_kv_cache_events": True}
            for rank, engine in enumerate(engines)}


def add_router_routes(app: FastAPI, ctx: ServerContext) -> None:
    """POST /v1/chat/completions/render, POST /v1/completions/render, GET /get_server_info,
    GET /kv_event_sources."""

    @app.post("/v1/chat/completions/render", responses=responses(RenderResponse, *RENDER_ERRORS))
    async def render_chat_ids(req: ChatCompletionRequest) -> dict[str, Any]:
        return {"token_ids": await render_chat(ctx, req)}

    @app.post("/v1/completions/render",
              responses=responses(CompletionRenderResponse, *RENDER_ERRORS))
    async def render_completion_ids(req: CompletionRequest) -> list[dict[str, Any]]:
        return [{"token_ids": ids} for ids in await render_completion(ctx, req)]

    @app.get("/get_server_info", responses=responses(ServerInfoResponse, 401))
    async def server_info() -> dict[str, Any]:
        block_size = ctx.engine.ready.block_size
        return {"model_id": ctx.model_name, "model_path": ctx.model_path or ctx.model_name,
                "instance_id": ctx.instance_id, "kv_block_size": block_size,
                "effective_attention_block_size": block_size, "worker_type": "regular",
                "max_model_len": ctx.max_model_len, "version": nanoserve.__version__,
                "cpu_isa": ctx.engine.ready.cpu_isa,
                "kernel_schedule": ctx.engine.ready.kernel_schedule}

    @app.get("/kv_event_sources",
             responses=responses(KVEventSourcesResponse, 401, 404))
    async def event_sources() -> dict[str, Any]:
        # a 404 is the router's "no events here" (it then routes this replica by load alone)
        if not ctx.kv_event_sources:
            raise APIError(404, "this server publishes no KV-cache events (start it with "
                                "--kv-events-config '{\"enable_kv_cache_events\": true}')")
        return ctx.kv_event_sources

"""One API server process: wait for the engine cores, then serve the HTTP API on the socket
the launcher bound (launcher.py starts the engine cores and runs this, or spawns N of these).

Its engine core dying (any one of them, with data parallelism: vLLM's choice) fails its
in-flight requests at once, answers /health with 503, and exits non-zero. A stop (the first
of `StopRequests`: a stop signal to the launcher, or the launcher's PARENT_STOP_SIGNAL to a
spawned API process) drains in-flight requests, bounded by --shutdown-timeout; a second stops
at once. A start that fails is one line on stderr (serving/engine_start.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess

import msgspec
import uvicorn

from nanoserve.config import EngineConfig
from nanoserve.engine.core_client import EngineCoreClient
from nanoserve.engine.dp_router import RoutingConfig
from nanoserve.engine.launch import EngineAddresses, engine_is_alive
from nanoserve.engine.stop_signals import PARENT_STOP_SIGNAL, StopRequests, ignore_stop_signals
from nanoserve.entrypoints.app import build_app
from nanoserve.entrypoints.openai.router_endpoints import instance_id, kv_event_sources
from nanoserve.entrypoints.serving.async_engine import AsyncEngine
from nanoserve.entrypoints.serving.closing_server import ClosingServer
from nanoserve.entrypoints.serving.dp_client import DPEngineClient
from nanoserve.entrypoints.serving.engine_start import (
    EngineStartError,
    print_start_failure,
    wait_for_engines,
)
from nanoserve.entrypoints.serving.error_handlers import drain
from nanoserve.entrypoints.serving.event_loop import run_event_loop
from nanoserve.entrypoints.serving.metrics import Metrics
from nanoserve.entrypoints.serving.model_names import ModelNames
from nanoserve.entrypoints.serving.process_exit import exit_now
from nanoserve.entrypoints.serving.request_logger import RequestLogger
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.entrypoints.web.router import page_banner
from nanoserve.model.frontend import FrontendModel, load_frontend
from nanoserve.model.model_path import resolve_model_path
from nanoserve.parsers.tool_format import template_tool_format
from nanoserve.protocol import EngineReady
from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sample.logits_processor import load_processor_classes
from nanoserve.server_config import ServerConfig
from nanoserve.structured.grammar import GrammarTokenizer

logger = logging.getLogger("nanoserve")
_ENGINE_START_TIMEOUT_S = 900.0


def api_process_main(engine_bytes: bytes, server_bytes: bytes, input_addresses: list[str],
                     output_addresses: list[str], index: int, engine_pids: list[int],
                     sock: socket.socket) -> None:
    """Entry point of one API-server process (configs arrive as msgpack, never pickled).
    It stops when its launcher says so (PARENT_STOP_SIGNAL) or is gone."""
    ignore_stop_signals()
    stops = StopRequests((PARENT_STOP_SIGNAL,))
    engine_config = msgspec.msgpack.decode(engine_bytes, type=EngineConfig)
    server_config = msgspec.msgpack.decode(server_bytes, type=ServerConfig)
    logging.basicConfig(level=server_config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s api-{index}: %(message)s")
    addresses = EngineAddresses(input_addresses, output_addresses)
    exit_now(run_event_loop(serve_api(engine_config, server_config, addresses, index, sock,
                                      stops, engine_pids=engine_pids, watch_parent=True)))


async def serve_api(engine_config: EngineConfig, server_config: ServerConfig,
                    addresses: EngineAddresses, index: int, sock: socket.socket,
                    stops: StopRequests, engine_pids: list[int],
                    engine_processes: list[BaseProcess] | None = None,
                    watch_parent: bool = False) -> int:
    """One API server: wait for the engine cores, then serve HTTP until `stops` says stop.
    Returns the exit status: 0 after a stop, 1 after a failed start or an engine's death."""
    _one_torch_thread()
    sockets = EngineCoreClient(addresses, index)

    def engine_alive() -> bool:  # all of them: one engine core gone fails the server
        if engine_processes is not None:
            return all(p.is_alive() for p in engine_processes)
        return all(engine_is_alive(pid) for pid in engine_pids)

    try:
        try:
            frontend = load_frontend(engine_config.model.model, engine_config.model.mmproj)
        except Exception as e:
            raise EngineStartError.of(e) from e
        ready = await wait_for_engines(sockets, engine_alive, lambda: stops.requested,
                                       _ENGINE_START_TIMEOUT_S)
    except EngineStartError as e:
        sockets.close()
        if index == 0:  # one line, not one per API process
            print_start_failure(e)
        return 1
    if ready is None:  # stopped while starting
        sockets.close()
        return 0
    parallel = engine_config.parallel
    client = DPEngineClient(sockets, RoutingConfig(
        policy=parallel.load_balance_method,
        balance_abs_threshold=max(1, engine_config.scheduler.max_num_seqs // 8)),
        ready.block_size)
    ctx = _server_context(engine_config, server_config, frontend, ready, client, engine_alive,
                          index, engine_pids)
    engine, name = ctx.engine, ctx.model_name
    app = build_app(ctx, server_config)
    server = DrainingServer(uvicorn.Config(
        app, log_level=server_config.log_level, access_log=False,
        timeout_graceful_shutdown=max(1, int(server_config.shutdown_timeout)),
        h11_max_incomplete_event_size=64 * 1024, **server_config.tls_options()), ctx,
        server_config.shutdown_timeout)
    stops.on_stop(server.stop_requested)
    if stops.requested:  # a stop between the engines' readiness and now: drain (nothing yet)
        server.stop_requested(stops.count)
    exit_status = 0

    def on_dead() -> None:
        nonlocal exit_status
        exit_status = 1
        # let the in-flight error responses go out, then stop
        asyncio.get_running_loop().call_later(0.5, _stop, server)

    engine.on_dead = on_dead
    engine.start()
    watchers = [asyncio.create_task(_watch_parent(server))] if watch_parent else []
    logger.info("serving %s on %s://%s:%d (API server %d, CPU kernels: %s)", name,
                server_config.scheme, server_config.host, server_config.port, index,
                ready.cpu_isa or "none")
    if server_config.web_ui and index == 0:
        # printed, not logged, so that it shows at any --log-level; the engine is ready and the
        # socket listens, so the page answers as soon as this line is read
        print(page_banner(server_config.host, server_config.port, name,
                          server_config.scheme), flush=True)
    try:
        await server.serve(sockets=[sock])
    finally:
        stops.on_stop(None)
        for task in watchers:
            task.cancel()
        await engine.stop()  # the engine cores are the launcher's to stop
        client.close()
    return exit_status



def _server_context(engine_config: EngineConfig, server_config: ServerConfig,
                    frontend: FrontendModel, ready: EngineReady, client: DPEngineClient,
                    engine_alive: Callable[[], bool], index: int,
                    engine_pids: list[int]) -> ServerContext:
    """What every route of this API server reads: the engine client over the ready engine
    cores, the tokenizer and template, the tool-call parser, the limits and the names."""
    name = server_config.served_model_name or ready.model_name
    tool_format = template_tool_format(server_config.chat_template
                                       or _template_text(frontend.tokenizer))
    tool_call_parser = server_config.tool_call_parser or tool_format.parser
    if server_config.tool_call_parser is None and index == 0:
        logger.info("tool calls read by the %s parser: %s (--tool-call-parser to choose)",
                    tool_format.parser, tool_format.reason)
    ctx_holder: list[ServerContext] = []
    metrics = Metrics(name, lambda: ctx_holder[0].engine.engine_stats)
    engine = AsyncEngine(client, frontend.tokenizer, ready, engine_alive, observer=metrics,
                         request_timeout=server_config.limits.request_timeout,
                         slow_reader_timeout=server_config.limits.slow_reader_timeout,
                         max_unread_updates=server_config.limits.max_unread_updates,
                         request_logger=RequestLogger(server_config.log_requests))
    ctx = ServerContext(
        engine=engine, tokenizer=frontend.tokenizer, model_name=name,
        max_model_len=ready.max_model_len, vocab_size=ready.vocab_size, metrics=metrics,
        generation_defaults=frontend.generation_config
        if server_config.generation_config == "auto" else {},
        reasoning_parser=server_config.reasoning_parser,
        tool_call_parser=tool_call_parser, template_reads_tools=tool_format.reads_tools,
        chat_template=server_config.chat_template,
        accepts_images=frontend.image_processor is not None,
        image_processor=frontend.image_processor,
        processor_classes=load_processor_classes(engine_config.sampler.logits_processors),
        reasoning_tokens=ReasoningTokens.of(frontend.tokenizer),
        grammar_tokenizer=GrammarTokenizer(frontend.tokenizer, ready.vocab_size, ()),
        max_logprobs=engine_config.sampler.max_logprobs,
        max_in_flight=server_config.max_in_flight, limits=server_config.limits,
        model_path=engine_config.model.model or ready.model_name,
        names=ModelNames({name: resolve_model_path(engine_config.model.model)}),
        fim_tokens=frontend.fim_tokens,
        instance_id=instance_id(server_config.port, engine_pids[0]),
        kv_event_sources=kv_event_sources(engine_config.kv_events,
                                          engine_config.parallel.data_parallel_size))
    ctx_holder.append(ctx)
    return ctx


class DrainingServer(ClosingServer):
    """uvicorn, except that a stop first drains: /health says 503 and new requests get 503
    while in-flight ones finish (bounded), then it stops; a second stop stops at once. The
    signals are the process's `StopRequests`, not uvicorn's own handlers (which would stop
    accepting at once and raise the signal again at exit)."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, timeout: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_timeout = timeout
        self.loop = asyncio.get_running_loop()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the process's StopRequests call
        yield  # stop_requested instead of uvicorn's handlers

    def stop_requested(self, count: int) -> None:
        """A stop (from a signal handler): the first drains, any later one stops now."""
        if count > 1 or self.ctx.shutting_down:
            self.force_exit = self.should_exit = True
            return
        self.ctx.shutting_down = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        async def drain_then_stop() -> None:
            await drain(self.ctx, self.drain_timeout)
            self.should_exit = True

        self.loop.create_task(drain_then_stop())


def _template_text(tokenizer: object) -> str | None:
    """The tokenizer's chat template source; of several named ones, the default."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None


def _stop(server: uvicorn.Server) -> None:
    server.should_exit = True


async def _watch_parent(server: uvicorn.Server) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    _stop(server)


def _one_torch_thread() -> None:
    """The API process computes no tensors worth threads; a torch pool here (torch comes only
    with a logits processor's plugin) would only wake workers on the cores the engine's
    threads use (engine/core_proc.py). Without torch loaded, nothing to do: it is not imported
    for this (~2.7 s of a core at each start)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)

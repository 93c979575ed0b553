"""`nanoserve serve`: the engine core in its own process, the HTTP API in one or more others.

    launcher ── spawns ──> engine core process (model, scheduler, sampler; no HTTP, no text),
       │                   or K of them (--data-parallel-size K), each on its share of the cores
       │
       └── runs the API server itself (--api-server-count 1, serve.py), or spawns N API
           processes that inherit its one listening socket (`listen.py`); each talks to every
           engine core over its own sockets and picks one per request (dp_client.py)

The port is bound first, before the engine starts: a busy port is a one-line error and exit
status 1 within a second, never a second server silently sharing the address. The engine cores
are spawned before the launcher imports the HTTP stack (this module imports nothing heavy), so
the engine's start and the API server's overlap: the default model answers `/health` in
7.6-8.4 s on 2 cores instead of ~12 s (docs/benchmarks.md, "A server's start and stop").

Lifetimes are tied both ways: the engine core exits when its launcher is gone; an API server
whose engine core dies fails its in-flight requests and exits non-zero (serve.py). Only this
process acts on a stop signal, however it was sent (to it alone or to the whole group: systemd,
a terminal's hang-up; engine/stop_signals.py): the API drains its in-flight requests (bounded
by --shutdown-timeout), then the engine cores are told to stop and write their disk tier; a
second signal stops at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
from multiprocessing.process import BaseProcess

import msgspec

from nanoserve.config import EngineConfig
from nanoserve.engine.cores import split_cores
from nanoserve.engine.launch import (
    EngineAddresses,
    kill_engine_processes,
    make_addresses,
    start_engine_process,
    stop_engine_processes,
)
from nanoserve.engine.stop_signals import (
    PARENT_STOP_SIGNAL,
    STOP_SIGNALS,
    StopRequests,
    held_for_children,
    ignore_stop_signals,
)
from nanoserve.entrypoints.serving.listen import AddressInUseError, bind_listening_socket
from nanoserve.server_config import ServerConfig


def run_serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """The launcher. Returns the process exit status."""
    logging.basicConfig(level=server_config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if engine_config.parallel.headless:  # another node's ranks: no engine core, no API
        from nanoserve.engine.tp_node import run_headless_node

        return run_headless_node(engine_config)
    stops = _stop_requests(server_config)
    try:
        sock = bind_listening_socket(server_config.host, server_config.port)
    except AddressInUseError as e:
        print(f"nanoserve serve: {e.strerror}", file=sys.stderr, flush=True)
        return 1
    count = server_config.api_server_count
    num_engines = engine_config.parallel.data_parallel_size
    addresses = make_addresses(count, num_engines)
    # data-parallel engine cores: each on its own share of the cores (one each on two)
    cores = split_cores(list(os.sched_getaffinity(0)), num_engines) if num_engines > 1 else None
    engines = [start_engine_process(engine_config, addresses, k, cores[k] if cores else None)
               for k in range(num_engines)]
    try:
        if count == 1:
            # imported only now: the engine cores are already starting beside this import
            from nanoserve.entrypoints.serve import run_event_loop, serve_api

            return run_event_loop(serve_api(
                engine_config, server_config, addresses, 0, sock, stops,
                engine_pids=[e.pid or 0 for e in engines], engine_processes=engines))
        return _run_api_processes(engine_config, server_config, addresses, engines, sock,
                                  stops)
    finally:
        sock.close()
        # the API has drained: now the engine cores, each writing its disk tier as it goes;
        # a stop signal meanwhile means now
        stops.on_stop(lambda _count: kill_engine_processes(engines))
        stop_engine_processes(engines, addresses)


def _stop_requests(server_config: ServerConfig) -> StopRequests:
    """What stops this launcher: SIGTERM, SIGINT or SIGHUP, or, under a `--models-dir`
    router, the router's PARENT_STOP_SIGNAL alone (engine/stop_signals.py)."""
    if server_config.stopped_by_parent:
        ignore_stop_signals()
        return StopRequests((PARENT_STOP_SIGNAL,))
    return StopRequests(STOP_SIGNALS)


def _api_process_main(engine_bytes: bytes, server_bytes: bytes, input_addresses: list[str],
                      output_addresses: list[str], index: int, engine_pids: list[int],
                      sock: socket.socket) -> None:
    """A spawned API server's entry: the HTTP stack is imported here, in the child."""
    from nanoserve.entrypoints.serve import api_process_main

    api_process_main(engine_bytes, server_bytes, input_addresses, output_addresses, index,
                     engine_pids, sock)


def _run_api_processes(engine_config: EngineConfig, server_config: ServerConfig,
                       addresses: EngineAddresses, engines: list[BaseProcess],
                       sock: socket.socket, stops: StopRequests) -> int:
    context = multiprocessing.get_context("spawn")
    # the socket travels as an inherited file descriptor (multiprocessing hands a socket
    # argument to a spawned child as a duplicated fd); every process accepts on that one socket
    procs = [context.Process(target=_api_process_main, name=f"nanoserve-api-{i}", args=(
        msgspec.msgpack.encode(engine_config), msgspec.msgpack.encode(server_config),
        addresses.inputs, addresses.outputs, i, [e.pid for e in engines], sock))
        for i in range(server_config.api_server_count)]
    with held_for_children():  # they ignore the stop signals: each stop is forwarded
        for proc in procs:
            proc.start()

    def forward(_count: int) -> None:  # the first drains, a second stops at once
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, PARENT_STOP_SIGNAL)

    stops.on_stop(forward)
    if stops.requested:  # a stop that came while they were being started
        forward(stops.count)
    status = 0
    for proc in procs:
        proc.join()
        status = status or (proc.exitcode or 0)
    return status

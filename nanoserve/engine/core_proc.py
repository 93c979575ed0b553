"""The engine core's own process: a busy loop around EngineCore, its input on a thread.

    API server(s) --EngineRequest/AbortRequests--> [input thread] --queue--> busy loop
    busy loop: take every queued input, then EngineCore.step(), then send its EngineOutputs
    to the API server that sent each request

The input thread receives and decodes while the loop computes (the GIL is released in the
kernels). Outputs leave from the loop itself, at once: a send hands the bytes to ZMQ's own
I/O thread and never waits (a message the socket cannot take yet, its queue full, waits in
`unsent` for the next turn of the loop). An output thread, as before, held each step's tokens
0.41 ms (median, one stream): until the loop next released the GIL, in the next step's
kernels, where it then took a core from them. The process exits when told to (Shutdown), when
its parent dies, or after an error in a step (it tells every API server first: EngineDead).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
from collections import defaultdict, deque
from typing import Any

import msgspec
import torch
import zmq

from nanoserve.config import EngineConfig
from nanoserve.engine.build import build_engine_core
from nanoserve.engine.kv_events import KVEventPublisher
from nanoserve.engine.start_failure import report_start_failure
from nanoserve.engine.stop_signals import ignore_stop_signals
from nanoserve.native import loaded_tier
from nanoserve.protocol import (
    AbortRequests,
    EngineCoreOutput,
    EngineDead,
    EngineInput,
    EngineOutputs,
    EngineReady,
    EngineRequest,
    RequestError,
    Shutdown,
    decode_input,
    encode,
)

logger = logging.getLogger("nanoserve")

_IDLE_WAIT_S = 0.5  # how long an idle loop blocks for input before checking its parent
_UNSENT_RETRY_S = 0.01  # how long it blocks while a message waits for a full socket queue


class EngineCoreProc:
    """Owns an EngineCore and the sockets to the API servers."""

    def __init__(self, config: EngineConfig, input_address: str,
                 output_addresses: list[str], engine_index: int = 0) -> None:
        self.core = build_engine_core(config, engine_tokenizer=True)  # the API makes text
        self.engine_index = engine_index  # among --data-parallel-size engine cores
        self.inputs: queue.Queue[EngineInput] = queue.Queue()
        self.output_socks: list[zmq.Socket[bytes]] = []  # one per API server; the loop's own
        self.unsent: deque[tuple[int, bytes]] = deque()  # (API server or -1: all, message)
        self.context = zmq.Context()
        self.input_address = input_address
        self.output_addresses = output_addresses
        self.client_of: dict[str, int] = {}  # request id -> API server index
        self.running = True
        # the prefix cache's changes for a router (--kv-events-config), sent off the loop
        # (engine core k on the configured ports plus k; its batches name it, as vLLM's do)
        self.kv_events = (KVEventPublisher(config.kv_events.for_engine(engine_index),
                                           data_parallel_rank=engine_index)
                          if config.kv_events.is_publishing else None)

    def ready_message(self) -> EngineReady:
        core = self.core
        return EngineReady(
            model_name=core.model_info.name, max_model_len=core.max_model_len,
            vocab_size=core.model_info.arch.vocab_size, num_blocks=core.kv_cache.num_blocks,
            block_size=core.config.cache.block_size,
            logits_processors=[f"{p.__module__}:{p.__qualname__}"
                               for p in core.admission.processor_classes],
            hidden_size=core.model_info.arch.hidden_size, pooling=core.config.model.pooling,
            engine_index=self.engine_index, cpu_isa=loaded_tier() or "",
            kernel_schedule=core.kernel_schedule,
            scheduling_policy=core.config.scheduler.scheduling_policy)

    # -- threads ------------------------------------------------------------------------------
    def _input_loop(self) -> None:
        sock = self.context.socket(zmq.PULL)
        sock.bind(self.input_address)
        while True:
            data = sock.recv()
            try:
                message = decode_input(data)
            except msgspec.DecodeError as e:  # never trust the wire: drop what does not decode
                logger.warning("dropped an undecodable message (%d bytes): %s", len(data), e)
                continue
            self.inputs.put(message)
            if isinstance(message, Shutdown):
                return

    # -- outputs ------------------------------------------------------------------------------
    def _open_outputs(self) -> None:
        for address in self.output_addresses:
            sock = self.context.socket(zmq.PUSH)
            sock.connect(address)
            self.output_socks.append(sock)

    def _post(self, client: int, data: bytes) -> None:
        """Queue one message for an API server (-1: for all) and send what can go now."""
        if client < 0:
            self.unsent.extend((c, data) for c in range(len(self.output_socks)))
        else:
            self.unsent.append((client, data))
        self._flush()

    def _flush(self) -> None:
        """Send the queued messages in order, until one finds its socket's queue full."""
        while self.unsent:
            client, data = self.unsent[0]
            try:
                self.output_socks[client].send(data, flags=zmq.NOBLOCK)
            except zmq.Again:
                return  # that API server is not reading; the next turn tries again
            self.unsent.popleft()

    def _close_outputs(self, wait_s: float) -> None:
        """Up to `wait_s` for what is unsent to go, then close (ZMQ delivers what it holds
        for another second)."""
        deadline = time.monotonic() + wait_s
        self._flush()
        while self.unsent and time.monotonic() < deadline:
            time.sleep(0.01)
            self._flush()
        for sock in self.output_socks:
            sock.close(linger=1000 if wait_s else 0)

    # -- the busy loop ------------------------------------------------------------------------
    def run(self, parent: int) -> None:
        """Until Shutdown, an error in a step, or launcher `parent` gone."""
        threading.Thread(target=self._input_loop, daemon=True, name="engine-input").start()
        self._open_outputs()
        self._broadcast(self.ready_message())
        orphaned = False
        try:
            while self.running:
                self._flush()
                # 1) inputs: block only when there is nothing to step
                changed = self._take_inputs(block=not self.core.has_unfinished())
                if os.getppid() != parent:
                    orphaned = True
                    break  # the launcher is gone: do not outlive it
                self.core.executor.check_health()  # a dead TP worker fails the engine, idle too
                # 2) one step; or, idle, let the API servers see what the inputs changed
                if self.core.has_unfinished():
                    self._send_outputs(self.core.step())
                    if self.kv_events is not None:
                        self.kv_events.publish(self.core.kv_cache.take_events())
                elif changed:
                    self._send_outputs([])
        except Exception:
            self._broadcast(EngineDead(traceback.format_exc(limit=20), self.engine_index))
            raise
        finally:
            # orphaned, nobody is left to read what is unsent
            self._close_outputs(wait_s=0 if orphaned else 5)

    def _take_inputs(self, block: bool) -> bool:
        changed = False
        # while a message waits for its API server's queue, the idle loop wakes to retry it
        timeout = _UNSENT_RETRY_S if self.unsent else _IDLE_WAIT_S
        try:
            message = self.inputs.get(timeout=timeout) if block else self.inputs.get_nowait()
            while True:
                changed |= self._handle(message)
                message = self.inputs.get_nowait()
        except queue.Empty:
            return changed

    def _handle(self, message: EngineInput) -> bool:
        if isinstance(message, EngineRequest):
            try:
                self.core.add_request(message.request_id, message.prompt_token_ids,
                                      message.params, message.prefill_leader,
                                      message.pooling_params, message.tenant, message.images)
                self.client_of[message.request_id] = message.client_index
            except ValueError as e:
                self._post(message.client_index, encode(RequestError(message.request_id, str(e))))
            return True
        if isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                self.core.abort(request_id)
                self.client_of.pop(request_id, None)
            return True
        self.running = False  # Shutdown
        return False

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            client = self.client_of.get(out.request_id, 0)
            by_client[client].append(out)
            if out.finish_reason is not None:
                self.client_of.pop(out.request_id, None)
        stats = self.core.stats
        now = time.time()
        for client in range(len(self.output_addresses)):  # everyone gets fresh stats
            self._post(client, encode(EngineOutputs(by_client.get(client, []), stats, now,
                                                    self.engine_index)))

    def _broadcast(self, message: msgspec.Struct) -> None:
        self._post(-1, encode(message))


def use_all_cores() -> None:
    """One torch thread per core this process may run on.

    Measured with `nanoserve bench serve --concurrency 1` on 2 cores: 2 threads 77.9 tok/s,
    1 thread 71.8 (the API process then has a core to itself, but the engine is slower), and
    OMP_WAIT_POLICY=PASSIVE (threads sleep between ops, leaving the cores to the API process)
    40.5: waking them costs more than the spinning takes from the API process.
    """
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))


def run_engine_core(config_bytes: bytes, input_address: str, output_addresses: list[str],
                    engine_index: int = 0, cores: list[int] | None = None) -> None:
    """Process entry point. The config arrives as msgpack bytes (never pickled objects).
    A data-parallel engine core runs on its share of the `cores` (its TP ranks split them).
    Stop signals are the launcher's to act on (engine/stop_signals.py)."""
    ignore_stop_signals()
    parent = _launcher_pid()
    loaded = threading.Event()
    threading.Thread(target=_exit_if_orphaned_while_loading, args=(parent, loaded),
                     daemon=True, name="engine-parent-watch").start()
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    if cores:
        os.sched_setaffinity(0, cores)
    use_all_cores()
    try:
        proc = EngineCoreProc(config, input_address, output_addresses, engine_index)
    except Exception as e:  # the API server prints the one line; the traceback at debug
        report_start_failure(e, output_addresses, engine_index)
        os._exit(1)
    proc.core.executor.pin_cores()
    loaded.set()  # from here the loop watches the launcher, and leaves cleanly
    status = 0
    try:
        proc.run(parent)
    except Exception:
        status = 1
    finally:
        proc.core.shutdown()  # no tensor-parallel worker outlives its engine
        # Leave now: a ZMQ context still holding the input thread's socket would make the
        # interpreter's exit wait on it forever. Tearing the context down can itself block
        # (a thread stuck sending to a dead API process): it gets two seconds, then we go.
        closer = threading.Thread(target=_destroy_quietly, args=(proc.context,), daemon=True)
        closer.start()
        closer.join(timeout=2.0)
        os._exit(status)


def _launcher_pid() -> int:
    """The process that spawned this one (as multiprocessing passed it: right even if the
    launcher died before this line ran)."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid else os.getppid()


def _exit_if_orphaned_while_loading(parent: int, loaded: threading.Event) -> None:
    """While the model loads (minutes, for a big one), leave as soon as the launcher is gone:
    nothing is in flight and nothing is cached yet."""
    while not loaded.wait(_IDLE_WAIT_S):
        if os.getppid() != parent:
            os._exit(1)


def _destroy_quietly(context: zmq.Context[Any]) -> None:
    with contextlib.suppress(Exception):
        context.destroy(linger=0)

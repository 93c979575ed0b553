"""Starting the engine-core processes, from a launcher that has not imported torch.

Addresses are IPC paths in a private temporary directory (one input socket bound by each engine
core, one output socket bound by each API server, which every engine core pushes to), so
nothing listens on the network but HTTP. With `--data-parallel-size` K there are K engine
cores, each with its own input; their messages say which one sent them (`engine_index`).

This module imports nothing heavy (no torch, no zmq, no engine), so `nanoserve serve` starts
its engine cores before it imports the HTTP stack: the engine's start (importing torch, loading
the weights, filling the KV cache) and the API process's (importing torch, transformers and
FastAPI, loading the tokenizer) then overlap (figures in entrypoints/launcher.py).

An engine core never acts on a stop signal (engine/stop_signals.py): its launcher stops it
with a `Shutdown` message once the API has drained, and it exits by itself if the launcher
is gone.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import msgspec

from nanoserve.config import EngineConfig
from nanoserve.engine.stop_signals import held_for_children

# after Shutdown, how long an engine core may take to end its step and write its disk tier
# (a whole 1 GiB cache spilled to disk is seconds); past it, it is killed
ENGINE_EXIT_WAIT_S = 30.0


@dataclass
class EngineAddresses:
    inputs: list[str]  # one per engine core
    outputs: list[str]  # one per API server
    directory: str = field(default="", repr=False)

    def cleanup(self) -> None:
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def make_addresses(num_clients: int, num_engines: int = 1) -> EngineAddresses:
    directory = tempfile.mkdtemp(prefix="nanoserve-")
    os.chmod(directory, 0o700)  # only this user may talk to the engine
    return EngineAddresses([f"ipc://{directory}/input-{k}" for k in range(num_engines)],
                           [f"ipc://{directory}/output-{i}" for i in range(num_clients)],
                           directory)


def _engine_core_main(config_bytes: bytes, input_address: str, output_addresses: list[str],
                      engine_index: int, cores: list[int] | None) -> None:
    """The spawned process's entry: the engine (and torch) are imported here, in the child."""
    from nanoserve.engine.core_proc import run_engine_core

    run_engine_core(config_bytes, input_address, output_addresses, engine_index, cores)


def start_engine_process(config: EngineConfig, addresses: EngineAddresses,
                         engine_index: int = 0, cores: list[int] | None = None) -> BaseProcess:
    """Spawn engine core `engine_index` (a fresh interpreter: no forked torch or sockets),
    pinned to `cores` when given, with the stop signals held (it ignores them)."""
    context = multiprocessing.get_context("spawn")
    process = context.Process(
        target=_engine_core_main, name=f"nanoserve-engine-core-{engine_index}", daemon=True,
        args=(msgspec.msgpack.encode(config), addresses.inputs[engine_index],
              addresses.outputs, engine_index, cores))
    with held_for_children():
        process.start()
    return process


def engine_is_alive(pid: int) -> bool:
    """True while process `pid` runs (a zombie, exited but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc here: trust os.kill


def stop_engine_processes(engines: list[BaseProcess], addresses: EngineAddresses) -> None:
    """Tell every engine core that serves to stop (`Shutdown`: it ends its step and writes its
    disk tier), wait up to ENGINE_EXIT_WAIT_S for them, kill what is left, remove the socket
    directory. One still loading its model (its input not yet bound) has nothing to keep and
    could not read the message: it is killed at once."""
    serving = [k for k, address in enumerate(addresses.inputs) if _is_bound(address)]
    _send_shutdown([addresses.inputs[k] for k in serving])
    deadline = time.monotonic() + ENGINE_EXIT_WAIT_S
    for k in serving:
        engines[k].join(timeout=max(0.0, deadline - time.monotonic()))
    kill_engine_processes(engines)
    addresses.cleanup()


def _is_bound(address: str) -> bool:
    return os.path.exists(address.removeprefix("ipc://"))


def kill_engine_processes(engines: list[BaseProcess]) -> None:
    """SIGKILL to each engine core still running (a second stop signal: stop at once); returns
    once they are gone. (Their tensor-parallel workers follow: they watch their parent.)"""
    for engine in engines:
        if engine.is_alive():
            engine.kill()
    for engine in engines:
        engine.join(timeout=5)


def _send_shutdown(input_addresses: list[str]) -> None:
    """`Shutdown` into each engine core's input; one that cannot take it within a second (it
    is gone, or never bound its socket) is left to the kill."""
    import zmq  # here, not at the top: the launcher imports this module before anything heavy

    from nanoserve.protocol import Shutdown, encode

    context = zmq.Context()
    try:
        for address in input_addresses:
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, 1000)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            with contextlib.suppress(zmq.Again):
                sock.send(encode(Shutdown()))
            sock.close()
    finally:
        context.term()

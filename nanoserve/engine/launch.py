"""Starting the engine-core processes, from a launcher that has not imported torch.

Addresses are IPC paths in a private temporary directory (one input socket bound by each engine
core, one output socket bound by each API server, which every engine core pushes to), so
nothing listens on the network but HTTP. With `--data-parallel-size` K there are K engine
cores, each with its own input; their messages say which one sent them (`engine_index`).

This module imports nothing heavy (no torch, no zmq, no engine), so `nanoserve serve` starts
its engine cores before it imports the HTTP stack: the engine's start (importing torch, loading
the weights, filling the KV cache) and the API process's (importing torch, transformers and
FastAPI, loading the tokenizer) then overlap (figures in entrypoints/launcher.py).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import msgspec

from nanoserve.config import EngineConfig


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
    pinned to `cores` when given."""
    context = multiprocessing.get_context("spawn")
    process = context.Process(
        target=_engine_core_main, name=f"nanoserve-engine-core-{engine_index}", daemon=True,
        args=(msgspec.msgpack.encode(config), addresses.inputs[engine_index],
              addresses.outputs, engine_index, cores))
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
    """Wait up to 5 s for the engine cores to exit (each was sent Shutdown, or is told by its
    launcher's exit), then terminate, then kill; remove the socket directory."""
    deadline = time.monotonic() + 5
    for engine in engines:
        engine.join(timeout=max(0.0, deadline - time.monotonic()))
    for engine in engines:
        if engine.is_alive():
            engine.terminate()
            engine.join(timeout=5)
        if engine.is_alive():
            engine.kill()
    addresses.cleanup()

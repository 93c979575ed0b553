"""Starting the engine-core processes, and the API server's end of their sockets.

Addresses are IPC paths in a private temporary directory (one input socket bound by each engine
core, one output socket bound by each API server, which every engine core pushes to), so
nothing listens on the network but HTTP. With `--data-parallel-size` K there are K engine
cores, each with its own input; their messages say which one sent them (`engine_index`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import msgspec
import zmq
import zmq.asyncio

from nanoserve.config import EngineConfig
from nanoserve.engine.core_proc import run_engine_core
from nanoserve.protocol import EngineInput, EngineMessage, decode_message, encode

logger = logging.getLogger("nanoserve")


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


def start_engine_process(config: EngineConfig, addresses: EngineAddresses,
                         engine_index: int = 0, cores: list[int] | None = None) -> BaseProcess:
    """Spawn engine core `engine_index` (a fresh interpreter: no forked torch or sockets),
    pinned to `cores` when given."""
    context = multiprocessing.get_context("spawn")
    process = context.Process(
        target=run_engine_core, name=f"nanoserve-engine-core-{engine_index}", daemon=True,
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


class EngineCoreClient:
    """asyncio sockets: requests out to each engine core, all their messages back in."""

    def __init__(self, addresses: EngineAddresses, client_index: int) -> None:
        self.context = zmq.asyncio.Context()
        self.inputs = []
        for address in addresses.inputs:  # one socket each: PUSH would spread over them
            sock = self.context.socket(zmq.PUSH)
            sock.connect(address)
            self.inputs.append(sock)
        self.output = self.context.socket(zmq.PULL)
        self.output.bind(addresses.outputs[client_index])
        self.client_index = client_index

    @property
    def num_engines(self) -> int:
        return len(self.inputs)

    async def send(self, message: EngineInput, engine: int = 0) -> None:
        await self.inputs[engine].send(encode(message))

    def send_nowait(self, message: EngineInput, engine: int = 0) -> None:
        """For paths that cannot await (a cancelled request's cleanup): queue it now."""
        self.inputs[engine].send(encode(message), flags=zmq.NOBLOCK)

    async def recv(self) -> EngineMessage:
        while True:
            data = await self.output.recv()
            try:
                return decode_message(data)
            except msgspec.DecodeError as e:  # never act on what does not decode
                logger.warning("dropped an undecodable message from the engine core "
                               "(%d bytes): %s", len(data), e)

    def close(self) -> None:
        for sock in self.inputs:
            sock.close(linger=0)
        self.output.close(linger=0)
        self.context.term()

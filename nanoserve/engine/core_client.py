"""Starting the engine-core process, and the API server's end of its sockets.

Addresses are IPC paths in a private temporary directory (one input socket bound by the engine,
one output socket bound by each API server), so nothing listens on the network but HTTP.
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
    input: str
    outputs: list[str]
    directory: str = field(default="", repr=False)

    def cleanup(self) -> None:
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def make_addresses(num_clients: int) -> EngineAddresses:
    directory = tempfile.mkdtemp(prefix="nanoserve-")
    os.chmod(directory, 0o700)  # only this user may talk to the engine
    return EngineAddresses(f"ipc://{directory}/input",
                           [f"ipc://{directory}/output-{i}" for i in range(num_clients)],
                           directory)


def start_engine_process(config: EngineConfig, addresses: EngineAddresses) -> BaseProcess:
    """Spawn the engine core (a fresh interpreter: no forked torch or sockets)."""
    context = multiprocessing.get_context("spawn")
    process = context.Process(
        target=run_engine_core, name="nanoserve-engine-core", daemon=True,
        args=(msgspec.msgpack.encode(config), addresses.input, addresses.outputs))
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
    """asyncio sockets: requests out to the engine core, its messages back in."""

    def __init__(self, addresses: EngineAddresses, client_index: int) -> None:
        self.context = zmq.asyncio.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.connect(addresses.input)
        self.output = self.context.socket(zmq.PULL)
        self.output.bind(addresses.outputs[client_index])
        self.client_index = client_index

    async def send(self, message: EngineInput) -> None:
        await self.input.send(encode(message))

    def send_nowait(self, message: EngineInput) -> None:
        """For paths that cannot await (a cancelled request's cleanup): queue it now."""
        self.input.send(encode(message), flags=zmq.NOBLOCK)

    async def recv(self) -> EngineMessage:
        while True:
            data = await self.output.recv()
            try:
                return decode_message(data)
            except msgspec.DecodeError as e:  # never act on what does not decode
                logger.warning("dropped an undecodable message from the engine core "
                               "(%d bytes): %s", len(data), e)

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.context.term()

"""The API server's end of the engine cores' sockets (their addresses and the processes
themselves: launch.py)."""

from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from nanoserve.engine.launch import EngineAddresses
from nanoserve.protocol import EngineInput, EngineMessage, decode_message, encode

logger = logging.getLogger("nanoserve")


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

"""KV-cache events in vLLM's format, published over ZMQ for a router that routes by cache.

`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'` makes the engine core tell subscribers
which full blocks its prefix cache holds: `BlockStored` when blocks become findable by hash,
`BlockRemoved` when they are evicted. `vllm-router --policy kv_aware` reads them; its wire
format, read against the router's 0.1.17 source:

- the PUB socket sends 3 frames per batch, `[topic, seq as 8-byte big-endian, payload]`;
  `seq` counts 0, 1, 2, ... with no gaps (a gap makes the router ask the replay socket);
- the payload is msgpack `[ts, [event, ...], data_parallel_rank]`, each event a map tagged
  by `"type"` with exactly the keys below (an unknown or missing key rejects the batch);
- `medium` is "GPU" for every event: the router admits only device blocks under that name
  (vLLM says "GPU" for its CPU backend's blocks too);
- the replay ROUTER socket answers `[id, b"", start_seq]` with `[id, b"", topic, seq,
  payload]` for each batch it still keeps from `start_seq` on, then the end frame
  `[id, b"", b"", -1, b""]`.

Block hashes go out as the first 8 bytes of our own block hash (kv_cache.py) as an unsigned
integer: the router hashes the token ids itself and uses ours only to chain parents and to
find removed blocks, so they need not match its own.
"""

from __future__ import annotations

import collections
import queue
import threading
import time

import msgspec
import zmq

from nanoserve.config import KVEventsConfig

MEDIUM = "GPU"  # what the router admits (see the top)


class BlockStored(msgspec.Struct, tag=True):
    """Full blocks, chained in order, that became findable in the prefix cache."""

    block_hashes: list[int]
    parent_block_hash: int | None  # None at the start of a sequence
    token_ids: list[int]  # len(block_hashes) * block_size of them, in order
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    """Blocks whose contents were evicted (their hash no longer finds them)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM


class AllBlocksCleared(msgspec.Struct, tag=True):
    """Every block is gone (the prefix cache was reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    """One step's events: `[ts, events, data_parallel_rank]` on the wire."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def wire_hash(block_hash: bytes) -> int:
    """Our 16-byte block hash as the unsigned 64-bit integer the router keys blocks by."""
    return int.from_bytes(block_hash[:8], "big")


_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """Sends each step's events on a PUB socket and answers replays from the last
    `buffer_steps` batches; a thread of its own does both, so a step only enqueues."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.pending: queue.Queue[list[KVEvent] | None] = queue.Queue()
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.bind(config.endpoint)  # bound here, so a busy port fails start-up at once
        self.replay: zmq.Socket | None = None
        if config.replay_endpoint:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.bind(config.replay_endpoint)
        self.kept: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps)
        self.next_seq = 0
        self.thread = threading.Thread(target=self._run, name="nanoserve-kv-events",
                                       daemon=True)
        self.thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (nothing is sent for an empty list)."""
        if events:
            self.pending.put(events)

    def shutdown(self) -> None:
        self.pending.put(None)
        self.thread.join(timeout=2.0)
        self.context.destroy(linger=0)

    def _run(self) -> None:
        topic = self.config.topic.encode()
        while True:
            self._answer_replays(topic)
            try:
                events = self.pending.get(timeout=0.01)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = msgspec.msgpack.encode(
                KVEventBatch(time.time(), events, self.data_parallel_rank))
            seq = self.next_seq.to_bytes(8, "big")
            self.kept.append((self.next_seq, payload))
            self.next_seq += 1
            self.pub.send_multipart([topic, seq, payload])

    def _answer_replays(self, topic: bytes) -> None:
        if self.replay is None:
            return
        while self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.kept):
                if seq >= start:
                    self.replay.send_multipart([client, b"", topic, seq.to_bytes(8, "big"),
                                                payload])
            self.replay.send_multipart([client, b"", b"", _END_OF_REPLAY, b""])

"""KV-cache events (engine/kv_events.py): what the cache records, and the wire a router reads.

The router's own decoder is the reference for the wire: each event a map with exactly the
keys it allows, batches `[ts, events, rank]`, frames `[topic, seq, payload]`, and the replay
socket's frames, as read in vllm-router 0.1.17's source. The real router reads them in
tests/entrypoints/test_vllm_router.py.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from test_kv_cache import admit as admit_request
from test_kv_cache import request

from nanoserve.config import KVEventsConfig
from nanoserve.engine.kv_cache import KVCacheManager, hash_block
from nanoserve.engine.kv_events import KVEventPublisher, wire_hash
from nanoserve.engine.request import Request

BLOCK = 4
STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
               "lora_id", "medium", "lora_name"}


def admit(kv: KVCacheManager, request_id: str, ids: list[int]) -> Request:
    """A request admitted as the scheduler admits it (test_kv_cache.py's admit)."""
    req = request(request_id, ids)
    admit_request(kv, req)
    return req


def test_stored_runs_chain_to_their_parents_and_evictions_are_named() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, record_events=True)
    first = admit(kv, "a", list(range(9)))  # 2 full blocks (and a partial one)
    [stored] = kv.take_events()
    h0 = hash_block(None, [0, 1, 2, 3])
    h1 = hash_block(h0, [4, 5, 6, 7])
    assert stored.block_hashes == [wire_hash(h0), wire_hash(h1)]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(8))
    assert stored.block_size == BLOCK and stored.medium == "GPU"
    assert kv.take_events() == []  # taken once

    # the same first block, another second one: only the new block, its parent named
    admit(kv, "b", [0, 1, 2, 3, 40, 41, 42, 43])
    [stored] = kv.take_events()
    assert stored.block_hashes == [wire_hash(hash_block(h0, [40, 41, 42, 43]))]
    assert stored.parent_block_hash == wire_hash(h0) and stored.token_ids == [40, 41, 42, 43]

    # freeing keeps the blocks cached; taking them for new tokens evicts the oldest first
    kv.free(first)
    admit(kv, "c", list(range(100, 108)))
    removed, stored = kv.take_events()
    assert removed.block_hashes == [wire_hash(h1)]  # a's tail went first, b holds h0
    assert stored.parent_block_hash is None and stored.token_ids == list(range(100, 108))


def test_nothing_is_recorded_unless_asked() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    admit(kv, "a", list(range(9)))
    assert kv.take_events() == [] and kv.stored is None and kv.pool.evicted is None


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    pub, replay = free_tcp_port(), free_tcp_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub}",
                            replay_endpoint=f"tcp://127.0.0.1:{replay}")
    running = KVEventPublisher(config)
    yield running
    running.shutdown()


def test_batches_go_out_numbered_and_replay_from_any_seq(publisher: KVEventPublisher) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, record_events=True)
    context = zmq.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 5000)
        sub.connect(publisher.config.endpoint)
        # a PUB drops what it sends before a subscriber has joined: send until one arrives
        admit(kv, "a", list(range(8)))
        events = kv.take_events()
        while not sub.poll(100):
            publisher.publish(events)
        frames = sub.recv_multipart()
        assert len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8
        first_seq = int.from_bytes(frames[1], "big")
        ts, [event], rank = msgspec.msgpack.decode(frames[2])
        assert ts > 0 and rank is None
        assert set(event) == STORED_KEYS and event["type"] == "BlockStored"
        assert event["token_ids"] == list(range(8)) and len(event["block_hashes"]) == 2

        admit(kv, "b", list(range(50, 54)))
        publisher.publish(kv.take_events())
        frames = sub.recv_multipart()
        assert int.from_bytes(frames[1], "big") == first_seq + 1  # no gap

        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        assert publisher.config.replay_endpoint is not None
        dealer.connect(publisher.config.replay_endpoint)
        dealer.send_multipart([b"", (first_seq + 1).to_bytes(8, "big")])
        _, topic, seq, payload = dealer.recv_multipart()
        assert topic == b"" and int.from_bytes(seq, "big") == first_seq + 1
        assert msgspec.msgpack.decode(payload)[1][0]["token_ids"] == [50, 51, 52, 53]
        assert dealer.recv_multipart() == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    finally:
        context.destroy(linger=0)


def test_the_config_names_an_unknown_key() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['endpiont'\]"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}')


def test_data_parallel_ports_that_would_collide_are_refused() -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6000",
                            replay_endpoint="tcp://127.0.0.1:6002")
    config.check_data_parallel(2)  # 6000, 6001 and 6002, 6003
    with pytest.raises(ValueError, match="collide at port 6002; set their ports at least 3"):
        config.check_data_parallel(3)
    assert config.for_engine(2).endpoint == "tcp://*:6002"

"""KVCacheManager: allocation, reference counts, hash-chained prefix reuse, LRU eviction."""

from __future__ import annotations

import pytest

from nanoserve.engine.kv_cache import KVCacheManager, hash_block
from nanoserve.engine.request import Request
from nanoserve.sampling_params import SamplingParams

BLOCK = 4


def request(request_id: str, ids: list[int]) -> Request:
    return Request(request_id, ids, SamplingParams())


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admit like the scheduler does: reuse cached blocks, allocate the rest, mark computed."""
    blocks, num_cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, blocks)
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return num_cached


def test_hash_chain_names_the_whole_prefix() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]),
                                                     [5, 6, 7, 8])


def test_allocation_rounds_up_and_free_returns_everything() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    req = request("a", list(range(9)))  # 9 tokens -> 3 blocks
    assert admit(kv, req) == 0
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 7
    req.append_output_token(99)  # token 10 still fits block 3
    assert kv.allocate_slots(req, 1) and len(kv.block_ids("a")) == 3
    kv.free(req)
    assert kv.num_free_blocks == 10


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK)
    req = request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_shared_prefix_is_reused_and_the_last_token_always_computed() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK)
    first = request("a", list(range(10)))  # blocks [0-3] [4-7] full, [8-9] partial
    admit(kv, first)
    second = request("b", [*range(8), 50, 51, 52])
    assert admit(kv, second) == 8  # both full blocks reused
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.pool.blocks[kv.block_ids("a")[0]].ref_count == 2
    # a prompt that is exactly cached still leaves its last block to compute
    third = request("c", list(range(8)))
    assert admit(kv, third) == 4
    assert kv.prefix_cache_hits == 12 and kv.prefix_cache_queries == 10 + 11 + 8


def cached_tokens(kv: KVCacheManager, ids: list[int]) -> int:
    return kv.get_computed_blocks(request("probe", ids))[1]


def test_released_blocks_stay_cached_until_evicted_least_recent_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK)
    old = request("old", list(range(8)))
    admit(kv, old)
    kv.free(old)
    new = request("new", list(range(100, 108)))
    admit(kv, new)
    kv.free(new)
    assert kv.num_free_blocks == 4  # cached blocks still count as free
    assert cached_tokens(kv, [*range(8), 1]) == 8
    # "old"'s blocks were released first, so a new allocation evicts them first
    admit(kv, request("filler", list(range(200, 208))))
    assert cached_tokens(kv, [*range(8), 1]) == 0
    assert cached_tokens(kv, [*range(100, 108), 1]) == 8


def test_freeing_tail_first_keeps_prefixes_longest() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK)
    req = request("a", list(range(12)))
    admit(kv, req)
    kv.free(req)
    # one new block evicts the *last* block of "a": its two-block prefix survives
    admit(kv, request("x", [7, 7, 7]))
    assert cached_tokens(kv, [*range(12), 1]) == 8


def test_disabled_prefix_caching_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    admit(kv, request("a", list(range(9))))
    assert admit(kv, request("b", list(range(9)))) == 0
    assert kv.prefix_cache_queries == 0


@pytest.mark.parametrize("num_blocks", [1, 7])
def test_usage_counts_held_blocks(num_blocks: int) -> None:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK)
    assert kv.usage == 0.0
    admit(kv, request("a", [1, 2]))
    assert kv.usage == pytest.approx(1 / num_blocks)

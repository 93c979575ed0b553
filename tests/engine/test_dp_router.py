"""The data-parallel routing policy on made-up loads and real block hashes (no engines)."""

from __future__ import annotations

import pytest

from nanoserve.engine.dp_router import (
    DPRouter,
    RoutingConfig,
    engine_load,
    prompt_block_hashes,
)
from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.request import Request
from nanoserve.sampling_params import SamplingParams

BLOCK = 4


def prompt(group: int, suffix: int, num_prefix_blocks: int = 4) -> list[int]:
    """A prompt of `num_prefix_blocks` blocks shared by its group, then one unique block."""
    return [1000 * group + i for i in range(num_prefix_blocks * BLOCK)] + [
        10**6 + 10 * suffix + i for i in range(BLOCK)]


def hashes(group: int, suffix: int) -> list[bytes]:
    return prompt_block_hashes(prompt(group, suffix), BLOCK)


def test_hashes_are_the_prefix_caches_own() -> None:
    ids = [*prompt(1, 1), 7, 8]  # a partial last block is not hashed
    cache = KVCacheManager(num_blocks=8, block_size=BLOCK)
    request = Request("r", ids, SamplingParams())
    assert prompt_block_hashes(ids, BLOCK) == cache.block_hashes(request)
    assert len(prompt_block_hashes(ids, BLOCK)) == 5
    assert prompt_block_hashes([1, 2, 3], BLOCK) == []



def test_a_salted_prompts_hashes_are_its_own_chain() -> None:
    """cache_salt: the router hashes a salted prompt as the engine keys it, and no block of it
    (the first included) matches the unsalted or another salt's chain."""
    ids = prompt(1, 1)
    cache = KVCacheManager(num_blocks=8, block_size=BLOCK)
    salted = Request("r", ids, SamplingParams(cache_salt="a"))
    assert prompt_block_hashes(ids, BLOCK, "a") == cache.block_hashes(salted)
    chains = [set(prompt_block_hashes(ids, BLOCK, salt)) for salt in (None, "a", "b")]
    assert not chains[0] & chains[1] and not chains[1] & chains[2] and not chains[0] & chains[2]


def test_a_shared_prefix_sticks_to_the_engine_that_saw_it() -> None:
    router = DPRouter(4)
    first = {group: router.route(hashes(group, 0), [0, 0, 0, 0]) for group in range(4)}
    assert sorted(first.values()) == [0, 1, 2, 3]  # nothing known yet: idle engines take turns
    for suffix in range(1, 6):
        for group in range(4):
            assert router.route(hashes(group, suffix), [1, 1, 1, 1]) == first[group]
    assert router.decisions["prefix_hit"] == 20
    assert router.match_shares(hashes(2, 99))[first[2]] == pytest.approx(4 / 5)


def test_a_match_at_or_below_the_threshold_goes_to_the_least_loaded() -> None:
    router = DPRouter(2, RoutingConfig(cache_threshold=0.8))
    home = router.route(hashes(0, 0), [0, 0])
    other = 1 - home
    loads = [0, 0]
    loads[home] = 3
    # 4 of 5 blocks match (0.8, not above 0.8): the least loaded engine, not the prefix's home
    assert router.route(hashes(0, 1), loads) == other
    assert router.decisions["prefix_miss"] == 2


def test_imbalance_overrides_the_prefix() -> None:
    config = RoutingConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    router = DPRouter(2, config)
    home = router.route(hashes(0, 0), [0, 0])
    loads = [0, 0]
    loads[home], loads[1 - home] = 10, 7  # 3 apart: not over the absolute threshold
    assert router.route(hashes(0, 1), loads) == home
    loads[home], loads[1 - home] = 30, 25  # 5 apart, but 30 < 1.5 x 25
    assert router.route(hashes(0, 2), loads) == home
    assert not router.decisions["load_imbalance"]
    loads[home], loads[1 - home] = 5, 0  # 5 - 0 > 4 and 5 > 1.5 x 0
    assert router.route(hashes(0, 3), loads) == 1 - home
    assert router.decisions["load_imbalance"] == 1
    # the engine chosen under imbalance learned the prefix too: now both hold it
    assert router.match_shares(hashes(0, 4)) == [pytest.approx(0.8)] * 2


def test_ties_rotate() -> None:
    router = DPRouter(3)
    unique = [router.route(hashes(g, 0), [2, 2, 2]) for g in range(6)]
    assert unique == [0, 1, 2, 0, 1, 2]  # equal loads, no match: each engine in turn
    router = DPRouter(3)
    for engine in range(3):  # teach every engine group 0's prefix
        router.routed_hashes[engine].update(dict.fromkeys(hashes(0, 0)))
    picks = [router.route(hashes(0, s), [1, 1, 1]) for s in range(1, 7)]
    assert picks == [0, 1, 2, 0, 1, 2]  # an equal best match: each engine in turn
    assert router.route(hashes(0, 9), [1, 0, 1]) == 1  # equal matches: the least loaded


def test_round_robin_spreads_evenly_whatever_the_prefix() -> None:
    router = DPRouter(3, RoutingConfig(policy="round_robin"))
    picks = [router.route(hashes(0, s), [5, 0, 0]) for s in range(9)]
    assert picks == [0, 1, 2] * 3
    assert not router.decisions and all(not known for known in router.routed_hashes)


def test_each_engines_set_is_capped_and_keeps_leading_blocks_longest() -> None:
    router = DPRouter(1, RoutingConfig(max_hashes_per_engine=8))
    router.route(hashes(0, 0), [0])  # 5 hashes
    router.route(hashes(1, 0), [0])  # 5 more: the 2 least recent of group 0 go
    known = router.routed_hashes[0]
    assert len(known) == 8
    group0 = hashes(0, 0)
    # learned last block first, so group 0's unique block and its 4th went; its start stayed
    assert [h in known for h in group0] == [True, True, True, False, False]
    assert router.match_shares(hashes(0, 1)) == [pytest.approx(3 / 5)]


def test_config_and_load_checks() -> None:
    with pytest.raises(ValueError, match="routing policy must be one of"):
        RoutingConfig(policy="random")
    with pytest.raises(ValueError, match="expected 2 loads"):
        DPRouter(2).route([], [0])
    assert engine_load(num_in_flight=3, num_waiting=1, num_running=1) == 3
    assert engine_load(num_in_flight=0, num_waiting=4, num_running=2) == 6

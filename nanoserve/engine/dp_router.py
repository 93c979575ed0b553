"""Which data-parallel engine core a request goes to: the cache-aware policy, or round-robin.

Each engine core has its own prefix cache, so a request whose prompt starts like one sent
before should go where that prompt went: its leading blocks are likely still cached there.
The router cannot see the engines' caches (that is the exact mode, from KV-cache events); it
remembers, per engine, the block hashes of the prompts it sent there (an LRU set of capped
size, llm-d's approximate index, SGLang's gateway's radix tree flattened to chained hashes).

`cache_aware`, the gateway's rule in four steps:
  1) imbalanced (max - min load > `balance_abs_threshold` and max > `balance_rel_threshold`
     x min): the least loaded engine, whatever the prefix;
  2) else the share of the prompt's full blocks each engine holds from the start;
  3) the best share above `cache_threshold` wins (the least loaded of equal shares), else the
     least loaded engine;
  4) the chosen engine learns the prompt's hashes.
Ties (equal shares, equal loads) rotate, so idle engines take turns instead of the first one
taking everything (vLLM #49204). `round_robin` is the baseline it is measured against
(`nanoserve bench route`).

The hashes are the engine's own (`kv_cache.hash_block`, chained over full blocks of the
engines' block size), so a hash here names the same prefix as a cached block there. Each
API server runs one router over its engine cores (entrypoints/serving/dp_client.py), so the API
process imports `hash_block` from the engine's KV cache; a lower, neutral module that both
import would be its better home.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nanoserve.config import LOAD_BALANCE_METHODS
from nanoserve.engine.block_hashes import chain_hashes, salt_root
from nanoserve.engine.state_cache import BlockHash
from nanoserve.protocol import ImageInput

ROUTING_POLICIES = LOAD_BALANCE_METHODS  # --load-balance-method


@dataclass(frozen=True)
class RoutingConfig:
    """The policy and its thresholds. Defaults: the gateway's `cache_threshold` 0.3 and
    `balance_rel_threshold` 1.5; `balance_abs_threshold` 8 = max_num_seqs (64) / 8, where the
    gateway's 64 assumes batches far larger than a CPU engine runs."""

    policy: str = "cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    max_hashes_per_engine: int = 1 << 16  # 1M tokens of prompt at block size 16

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, "
                             f"got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.max_hashes_per_engine < 1:
            raise ValueError("max_hashes_per_engine must be >= 1, got "
                             f"{self.max_hashes_per_engine}")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None,
                        images: Sequence[ImageInput] = ()) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks, as the engine's prefix cache keys them
    (a salted request's from its salt's root; its images' keys in the blocks they overlap)."""
    return chain_hashes(token_ids, block_size, salt_root(cache_salt), images, [])


def engine_load(num_in_flight: int, num_waiting: int, num_running: int) -> int:
    """An engine's load as the router counts it: the larger of what this API server has in
    flight there and what the engine last reported (its reports lag; vLLM PR #49204)."""
    return max(num_in_flight, num_waiting + num_running)


class DPRouter:
    """Picks an engine core per request from its prompt's block hashes and the engines' loads.
    Pure: no sockets, no clocks; the caller counts loads and sends the request."""

    def __init__(self, num_engines: int, config: RoutingConfig | None = None) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        self.config = config or RoutingConfig()
        # per engine: block hash -> None, least recently routed first
        self.routed_hashes: list[OrderedDict[BlockHash, None]] = [
            OrderedDict() for _ in range(num_engines)]
        self.decisions: Counter[str] = Counter()  # prefix_hit | prefix_miss | load_imbalance
        self._next = 0  # where the rotation of ties (and round robin) starts

    def route(self, block_hashes: Sequence[BlockHash], loads: Sequence[int]) -> int:
        """The engine for a prompt with these full-block hashes, given each engine's load."""
        if len(loads) != self.num_engines:
            raise ValueError(f"expected {self.num_engines} loads, got {len(loads)}")
        if self.config.policy == "round_robin":
            return self._take(range(self.num_engines))
        if self._is_imbalanced(loads):  # 1)
            self.decisions["load_imbalance"] += 1
            chosen = self._least_loaded(range(self.num_engines), loads)
        else:
            shares = self.match_shares(block_hashes)  # 2)
            best = max(shares)
            if block_hashes and best > self.config.cache_threshold:  # 3)
                self.decisions["prefix_hit"] += 1
                chosen = self._least_loaded([i for i, s in enumerate(shares) if s == best],
                                            loads)
            else:
                self.decisions["prefix_miss"] += 1
                chosen = self._least_loaded(range(self.num_engines), loads)
        self._learn(chosen, block_hashes)  # 4)
        return chosen

    def match_shares(self, block_hashes: Sequence[BlockHash]) -> list[float]:
        """Per engine, the share of the prompt's blocks it was sent, counted from the start
        (a chained hash names its whole prefix, so the run stops at the first unknown one)."""
        if not block_hashes:
            return [0.0] * self.num_engines
        shares = []
        for known in self.routed_hashes:
            num_matched = 0
            for block_hash in block_hashes:
                if block_hash not in known:
                    break
                num_matched += 1
            shares.append(num_matched / len(block_hashes))
        return shares

    def _is_imbalanced(self, loads: Sequence[int]) -> bool:
        high, low = max(loads), min(loads)
        return (high - low > self.config.balance_abs_threshold
                and high > self.config.balance_rel_threshold * low)

    def _least_loaded(self, engines: Sequence[int], loads: Sequence[int]) -> int:
        low = min(loads[i] for i in engines)
        return self._take(i for i in engines if loads[i] == low)

    def _take(self, candidates: Iterable[int]) -> int:
        """The first candidate at or after the rotation point; the point moves past it."""
        n = self.num_engines
        chosen = min(candidates, key=lambda i: (i - self._next) % n)
        self._next = (chosen + 1) % n
        return chosen

    def _learn(self, engine: int, block_hashes: Sequence[BlockHash]) -> None:
        """Remember the prompt's hashes there. Added last block first, so the leading blocks,
        shared by the most prompts, are the freshest and the last evicted."""
        known = self.routed_hashes[engine]
        for block_hash in reversed(block_hashes):
            known[block_hash] = None
            known.move_to_end(block_hash)
        while len(known) > self.config.max_hashes_per_engine:
            known.popitem(last=False)

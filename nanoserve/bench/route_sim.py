"""The simulation behind `nanoserve bench route` (route.py): replicas as real prefix caches
without a model, behind the data-parallel router."""

from __future__ import annotations

import heapq
import statistics
from collections import deque

from nanoserve.bench.route_data import RouteResult, TraceEntry, Workload
from nanoserve.engine.dp_router import DPRouter, RoutingConfig, prompt_block_hashes
from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.request import Request
from nanoserve.sampling_params import SamplingParams


class SimEngine:
    """One replica: the real KV-cache manager, a FIFO of waiting requests, the running ones."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.cache = KVCacheManager(w.num_blocks, w.block_size)
        self.waiting: deque[tuple[float, Request]] = deque()
        self.num_running = 0
        self.num_routed = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    @property
    def load(self) -> int:
        return len(self.waiting) + self.num_running

    def admit(self, now: float) -> list[tuple[float, Request, float]]:
        """Admit waiting requests in order while they fit: (finish step, request, wait)."""
        admitted = []
        while self.waiting and self.num_running < self.w.max_num_seqs:
            arrival, request = self.waiting[0]
            hits, num_cached = self.cache.get_computed_blocks(request)
            output_len = request.params.max_tokens or 0
            num_new = request.num_prompt_tokens - num_cached + output_len
            if not self.cache.allocate_slots(request, num_new, hits):
                break  # head of line waits for blocks, as the scheduler's FIFO does
            self.waiting.popleft()
            request.num_computed_tokens = request.num_prompt_tokens
            self.cache.cache_blocks(request)  # its prompt's blocks are findable from now
            self.num_running += 1
            self.num_prompt_tokens += request.num_prompt_tokens
            self.num_cached_tokens += num_cached
            num_uncached = request.num_prompt_tokens - num_cached
            steps = -(-num_uncached // self.w.prefill_chunk) + output_len
            admitted.append((now + steps, request, now - arrival))
        return admitted

    def finish(self, request: Request) -> None:
        self.cache.free(request)
        self.num_running -= 1


def simulate(w: Workload, policy: str, num_replicas: int,
             trace: list[TraceEntry]) -> RouteResult:
    """Replay `trace` against `num_replicas` engines behind `policy` (`w` gives the
    engines; its trace fields are not read)."""
    needed = max(-(-(len(prompt) + out) // w.block_size) for _, prompt, out in trace)
    if needed > w.num_blocks:
        raise ValueError(f"a request needs {needed} blocks; --num-blocks is {w.num_blocks}")
    engines = [SimEngine(w) for _ in range(num_replicas)]
    router = DPRouter(num_replicas, RoutingConfig(
        policy=policy, balance_abs_threshold=max(1, w.max_num_seqs // 8)))
    # (finish step, tie-break order, engine index, request), earliest first
    finishes: list[tuple[float, int, int, Request]] = []
    waits: list[float] = []
    order = 0

    def start(index: int, now: float) -> None:
        nonlocal order
        for done, request, wait in engines[index].admit(now):
            waits.append(wait)
            heapq.heappush(finishes, (done, order, index, request))
            order += 1

    def finish_until(now: float) -> None:
        while finishes and finishes[0][0] <= now:
            done, _, index, request = heapq.heappop(finishes)
            engines[index].finish(request)
            start(index, done)

    for i, (arrival, prompt, output_len) in enumerate(trace):
        finish_until(arrival)
        index = router.route(prompt_block_hashes(prompt, w.block_size),
                             [e.load for e in engines])
        request = Request(f"r{i}", prompt, SamplingParams(max_tokens=output_len))
        engines[index].waiting.append((arrival, request))
        engines[index].num_routed += 1
        start(index, arrival)
    finish_until(float("inf"))
    routed = [e.num_routed for e in engines]
    hit_rate = (sum(e.num_cached_tokens for e in engines)
                / sum(e.num_prompt_tokens for e in engines))
    return RouteResult(policy, num_replicas, hit_rate, max(routed) / statistics.mean(routed),
                       statistics.mean(waits), _p90(waits), router.decisions["load_imbalance"])


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

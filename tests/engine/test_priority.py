"""vLLM's `--scheduling-policy priority`: the waiting queue by (priority, arrival), lower
first; the running request of the highest value preempted first; fcfs refuses a priority in
vLLM's words. The scheduler alone (a fixed sampled token, as test_scheduler.py), then the
engine on the tiny model: the order changes, the tokens do not."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import make_engine

from nanoserve.config import SchedulerConfig, check_priority
from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.scheduler import Scheduler
from nanoserve.sampling_params import SamplingParams

BLOCK = 4


def scheduler(max_num_seqs: int, num_blocks: int = 64, policy: str = "priority") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                     scheduling_policy=policy),
                     KVCacheManager(num_blocks, BLOCK), 64)


def add(s: Scheduler, request_id: str, priority: int, num_prompt: int = 3,
        max_tokens: int = 4) -> Request:
    request = Request(request_id, [10 + i for i in range(num_prompt)],
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority))
    s.add_request(request)
    return request


def step(s: Scheduler) -> list[str]:
    """One step; the ids of the requests admitted in it."""
    out = s.schedule()
    s.update_after_step(out, [7] * sum(1 for x in out.scheduled if x.samples))
    return [r.request_id for r in out.admitted]


def test_the_waiting_queue_runs_lower_values_first_and_ties_by_arrival() -> None:
    s = scheduler(max_num_seqs=1)
    for request_id, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -3), ("e", 0)):
        add(s, request_id, priority)
    admitted = []
    while s.has_unfinished():
        admitted += step(s)
    assert admitted == ["d", "b", "e", "a", "c"]
    fcfs = scheduler(max_num_seqs=1, policy="fcfs")
    for request_id in "abc":
        add(fcfs, request_id, 0)
    order = []
    while fcfs.has_unfinished():
        order += step(fcfs)
    assert order == ["a", "b", "c"]


def test_a_later_high_priority_request_passes_every_queued_one() -> None:
    s = scheduler(max_num_seqs=2)
    for i in range(5):
        add(s, f"low{i}", 10, max_tokens=6)
    assert step(s) == ["low0", "low1"]  # the server is full; low2..4 queue
    add(s, "high", -1)
    admitted = []
    while s.has_unfinished():
        admitted += step(s)
    assert admitted[0] == "high" and admitted[1:] == ["low2", "low3", "low4"]


def test_blocks_running_out_preempt_the_lowest_priority_not_the_newest() -> None:
    s = scheduler(max_num_seqs=4, num_blocks=6)  # 24 token slots
    urgent = add(s, "urgent", -5, num_prompt=7, max_tokens=8)
    relaxed = add(s, "relaxed", 9, num_prompt=7, max_tokens=8)
    normal = add(s, "normal", 0, num_prompt=7, max_tokens=8)  # the newest
    step(s)  # all three prefilled: 2 blocks each
    while all(r.status != RequestStatus.PREEMPTED for r in (urgent, relaxed, normal)):
        step(s)
    assert relaxed.status == RequestStatus.PREEMPTED
    assert urgent.status == normal.status == RequestStatus.RUNNING
    while s.has_unfinished():
        step(s)
    assert all(r.num_output_tokens == 8 for r in (urgent, relaxed, normal))


def test_fcfs_refuses_a_priority_in_vllms_words() -> None:
    with pytest.raises(ValueError, match="^Got priority 3 but Priority scheduling is not "
                                         r"enabled\.$"):
        check_priority(3, "fcfs")
    check_priority(0, "fcfs")
    check_priority(-7, "priority")
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority must be a 64-bit integer"):
        SamplingParams(priority=2**70)


def test_the_engine_reorders_requests_and_keeps_their_tokens(tiny_model_dir: Any) -> None:
    prompts = {f"low{i}": [100 + i, 200, 300 + i, 400] for i in range(4)}
    prompts["high"] = [500, 600, 700]

    def run(policy: str) -> tuple[list[str], dict[str, list[int]]]:
        engine = make_engine(tiny_model_dir("llama"), max_num_seqs=1, scheduling_policy=policy)
        firsts: list[str] = []
        tokens: dict[str, list[int]] = {}
        for request_id, ids in prompts.items():
            priority = -1 if request_id == "high" and policy == "priority" else 0
            engine.add_request(request_id, ids, SamplingParams(
                max_tokens=5, temperature=0.8, seed=11, priority=priority))
            if request_id == "low0":
                engine.step()  # low0 runs; the rest arrive while it does
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id not in tokens:
                    firsts.append(out.request_id)
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return firsts, tokens

    fcfs_order, fcfs_tokens = run("fcfs")
    assert fcfs_order == ["low0", "low1", "low2", "low3", "high"]
    priority_order, priority_tokens = run("priority")
    assert priority_order == ["low0", "high", "low1", "low2", "low3"]
    assert priority_tokens == fcfs_tokens

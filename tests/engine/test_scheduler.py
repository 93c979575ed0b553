"""Scheduler: token budget, sequence cap, chunked prefill, preemption, aborts, length limits.

These drive the scheduler alone, standing in for the model with a fixed sampled token.
"""

from __future__ import annotations

import pytest

from nanoserve.config import SchedulerConfig
from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.scheduler import Scheduler, SchedulerOutput
from nanoserve.sampling_params import SamplingParams

BLOCK = 4


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 32,
         max_model_len: int = 128) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                     kv, max_model_len)


def add(s: Scheduler, request_id: str, num_prompt: int, max_tokens: int = 4) -> Request:
    req = Request(request_id, [10 + i for i in range(num_prompt)],
                  SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    s.add_request(req)
    return req


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_after_step(out, [7] * sum(1 for x in out.scheduled if x.samples))
    return out


def test_budget_chunks_long_prompts_and_decodes_go_first() -> None:
    s = make(budget=10)
    a = add(s, "a", 3)
    b = add(s, "b", 25)
    first = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in first.scheduled] == \
        [("a", 3), ("b", 7)]
    second = step(s)  # a decodes (1 token) before b's next chunk takes the rest
    assert [(x.request.request_id, x.num_new_tokens) for x in second.scheduled] == \
        [("a", 1), ("b", 9)]
    assert a.num_output_tokens == 2 and b.num_output_tokens == 0
    while b.num_output_tokens == 0:
        assert step(s).num_tokens <= 10
    assert b.num_computed_tokens == 25


def test_long_prefill_token_threshold_caps_a_requests_chunk_not_the_step() -> None:
    """vLLM's --long-prefill-token-threshold: a prompt computes at most that many tokens a
    step, so the budget it leaves goes to others (here, a second prompt); decodes are not
    touched."""
    kv = KVCacheManager(64, BLOCK)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=6),
                  kv, 128)
    a = add(s, "a", 20)
    add(s, "b", 4)
    chunks = [[(x.request.request_id, x.num_new_tokens) for x in step(s).scheduled]
              for _ in range(4)]
    assert chunks == [[("a", 6), ("b", 4)], [("a", 6), ("b", 1)], [("a", 6), ("b", 1)],
                      [("a", 2), ("b", 1)]]
    assert a.num_computed_tokens == 20 and a.num_output_tokens == 1
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_max_num_seqs_caps_running_requests() -> None:
    s = make(max_num_seqs=2)
    for i in range(4):
        add(s, str(i), 2)
    out = step(s)
    assert len(out.scheduled) == 2 and len(s.running) == 2 and len(s.waiting) == 2


def test_preempts_the_newest_request_and_recomputes_it() -> None:
    s = make(num_blocks=4, budget=64, max_model_len=16)  # 16 token slots in all
    old = add(s, "old", 7, max_tokens=8)
    new = add(s, "new", 7, max_tokens=8)
    step(s)  # both prefilled: 2 + 2 blocks
    while new.status != RequestStatus.PREEMPTED:
        step(s)
    assert old.status == RequestStatus.RUNNING and new.num_computed_tokens == 0
    assert new.slot is None and s.waiting[0] is new
    kept = list(new.output_token_ids)
    while s.has_unfinished():
        step(s)
    assert old.num_output_tokens == 8 and new.num_output_tokens == 8
    assert new.output_token_ids[: len(kept)] == kept  # recompute keeps what was generated
    assert s.kv_cache.num_free_blocks == 4 and sorted(s.free_slots) == list(range(8))


def test_prompt_must_leave_room_below_max_model_len() -> None:
    s = make(max_model_len=16)
    with pytest.raises(ValueError, match=r"16 tokens.*max_model_len is 16"):
        add(s, "x", 16)
    with pytest.raises(ValueError, match="empty"):
        add(s, "y", 0)
    add(s, "ok", 15)


def test_generation_stops_at_max_model_len() -> None:
    s = make(max_model_len=12)
    req = add(s, "a", 10, max_tokens=100)
    while s.has_unfinished():
        step(s)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_tokens == 12


def test_abort_frees_blocks_and_slot_in_any_state() -> None:
    s = make(max_num_seqs=1)
    running = add(s, "run", 9)
    waiting = add(s, "wait", 5)
    step(s)
    assert s.kv_cache.num_free_blocks < 64
    assert s.abort("run") is running and s.abort("wait") is waiting
    assert s.abort("missing") is None
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert not s.has_unfinished() and s.kv_cache.num_free_blocks == 64
    assert s.free_slots == [0]


def test_stop_token_ids_and_eos() -> None:
    s = make()
    req = Request("a", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    s.add_request(req)
    step(s)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 7
    eos = Request("b", [1, 2], SamplingParams(max_tokens=10), eos_token_ids=(7,))
    s.add_request(eos)
    step(s)
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None


def test_duplicate_request_id_is_refused() -> None:
    s = make()
    add(s, "a", 2)
    with pytest.raises(ValueError, match="already"):
        add(s, "a", 2)

"""EngineCore on a real (tiny) model: prefix caching, block accounting, seeds, aborts."""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers import make_engine, run_to_completion

from nanoserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: Any) -> str:
    return str(tiny_model_dir("llama"))


def test_shared_prefix_computes_only_new_tokens(llama_dir: str) -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 49152) for _ in range(200)]
    first = prefix + [rng.randrange(3, 49152) for _ in range(10)]
    second = prefix + [rng.randrange(3, 49152) for _ in range(23)]

    engine = make_engine(llama_dir)
    run_to_completion(engine, {"first": first}, GREEDY)
    before = engine.stats.num_computed_tokens
    hits_before = engine.stats.prefix_cache_hits
    engine.add_request("second", second, GREEDY)
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
    reused = 200 // 16 * 16  # the prefix's full blocks
    assert cached == reused
    assert engine.stats.prefix_cache_hits - hits_before == reused
    # only the 23 + 8 new prompt tokens, then 7 decodes (the 8th token is never fed back)
    assert engine.stats.num_computed_tokens - before == len(second) - reused + 7

    cold = make_engine(llama_dir, enable_prefix_caching=False)
    assert run_to_completion(cold, {"second": second}, GREEDY)["second"] == out


def test_no_blocks_leak_through_adds_aborts_and_preemptions(llama_dir: str) -> None:
    engine = make_engine(llama_dir, num_blocks=24, max_num_batched_tokens=40,
                         max_model_len=256)
    kv = engine.kv_cache
    assert kv.num_free_blocks == 24
    rng = random.Random(7)
    live: list[str] = []
    for i in range(160):
        action = rng.random()
        if action < 0.3:
            rid = f"r{i}"
            ids = [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 120))]
            if rng.random() < 0.3 and live:  # share a prefix with a live request sometimes
                ids = engine.scheduler.requests[live[0]].prompt_token_ids[:40] + ids
            engine.add_request(rid, ids[:200], SamplingParams(
                temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randrange(1, 40),
                ignore_eos=True))
            live.append(rid)
        elif action < 0.4 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        else:
            for out in engine.step():
                if out.finish_reason is not None:
                    live.remove(out.request_id)
            _check_block_table(engine)
    assert engine.stats.num_preemptions > 0, "the mix should have forced preemption"
    while engine.has_unfinished():
        engine.step()
    assert kv.num_free_blocks == 24
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
    assert kv.req_blocks == {} and engine.scheduler.requests == {}
    assert sorted(engine.scheduler.free_slots) == list(range(64))


def _check_block_table(engine: Any) -> None:
    """The core's per-slot table, kept incrementally, holds each running request's blocks
    (slots are reused by later requests and preempted ones come back in other slots)."""
    table = engine.block_table
    for request in engine.scheduler.running:
        ids = engine.kv_cache.block_ids(request.request_id)
        if request.slot is None or not ids:
            continue
        if table.num_blocks[request.slot] == len(ids):  # synced at its last scheduled step
            assert table.table[request.slot, : len(ids)].tolist() == ids


def test_seeded_sampling_is_reproducible_and_batch_independent(llama_dir: str) -> None:
    prompt = [5, 6, 7, 8, 9]
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=42, ignore_eos=True)
    alone = run_to_completion(make_engine(llama_dir), {"s": prompt}, seeded)["s"]
    crowd = {f"n{i}": [i + 3] * (i + 2) for i in range(5)}
    engine = make_engine(llama_dir)
    for rid, ids in crowd.items():
        engine.add_request(rid, ids, SamplingParams(temperature=1.0, max_tokens=16))
    batched = run_to_completion(engine, {"s": prompt}, seeded)["s"]
    assert alone == batched
    other_seed = SamplingParams(temperature=1.0, max_tokens=16, seed=43, ignore_eos=True)
    assert run_to_completion(make_engine(llama_dir), {"s": prompt}, other_seed)["s"] != alone


def test_refuses_out_of_vocab_token_ids(llama_dir: str) -> None:
    engine = make_engine(llama_dir)
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request("x", [1, 49152], GREEDY)
    assert not engine.has_unfinished()


def test_max_model_len_past_the_models_context_needs_the_opt_in(
        llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN, spelled NANOSERVE_ALLOW_LONG_MAX_MODEL_LEN: without
    it a max_model_len past the model's 1,024 positions is refused naming the variable; with it
    a prompt past them runs (benchmarks of long prompts on a short-context model)."""
    monkeypatch.delenv("NANOSERVE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match="exceeds the model's context of 1024; set "
                                         "NANOSERVE_ALLOW_LONG_MAX_MODEL_LEN=1"):
        make_engine(llama_dir, max_model_len=1500)
    monkeypatch.setenv("NANOSERVE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    engine = make_engine(llama_dir, max_model_len=1500)
    prompt = [random.Random(3).randrange(3, 49152) for _ in range(1200)]
    out = run_to_completion(engine, {"long": prompt}, GREEDY)["long"]
    assert len(out) == GREEDY.max_tokens

"""Draft tokens and the KV cache: rejected positions never reach the prefix cache, preemption
drops pending drafts, and no draft runs past `max_model_len`; outputs equal the runs without
drafts throughout.

On the default model's GGUF (draft rows equal one-token decodes bit for bit), with the
adversarial proposer of tests/entrypoints/scripted_drafts.py: its drafts are the true
continuation corrupted at random places, so windows are partly rejected and their stale keys
and values sit in blocks the request keeps.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import make_engine

from nanoserve.engine.core import EngineCore
from nanoserve.engine.drafts import load_draft_proposer
from nanoserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "entrypoints"))
from scripted_drafts import Adversarial

pytestmark = pytest.mark.slow
NO_ROW_BUDGET = 256
PROMPTS = ["Count on: 1, 2, 3, 4, 5, 6,", "Once upon a time, there was a small robot who",
           "Q: Name three colours.\nA:", "The list goes: red, green, blue, red, green,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=40)


def engine_for(**kwargs: Any) -> EngineCore:
    engine = make_engine(None, quantization="gguf", **kwargs)
    engine.config = dataclasses.replace(engine.config, scheduler=dataclasses.replace(
        engine.config.scheduler, speculative_max_rows=NO_ROW_BUDGET))
    return engine


def run(engine: EngineCore, prompts: dict[str, list[int]], params: dict[str, SamplingParams],
        drafting: bool) -> dict[str, list[int]]:
    engine.proposer = load_draft_proposer(Adversarial if drafting else None)
    try:
        for name, ids in prompts.items():
            engine.add_request(name, ids, params[name])
        got: dict[str, list[int]] = {name: [] for name in prompts}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
    finally:
        engine.proposer = None
    return got


def scripted(params: SamplingParams, truth: list[int]) -> SamplingParams:
    return dataclasses.replace(params, extra_args={"draft_script": truth + [7] * 8,
                                                   "draft_corrupt_rate": 0.3})


@pytest.fixture(scope="module")
def encode() -> Any:
    return engine_for().model_info.tokenizer.encode


def test_after_rejected_drafts_a_prefix_cache_hit_gives_the_same_output(encode: Any) -> None:
    """A first request drafts and has drafts rejected; a second one whose prompt is the first's
    prompt and output reuses the cached blocks. Had a rejected draft's keys and values reached
    a cached block, the second output would differ from a fresh engine's."""
    prompt = encode(PROMPTS[1])
    fresh = engine_for()
    truth = run(fresh, {"a": prompt}, {"a": GREEDY}, drafting=False)["a"]
    engine = engine_for()
    first = run(engine, {"a": prompt}, {"a": scripted(GREEDY, truth)}, drafting=True)["a"]
    assert first == truth
    accepted, drafted = (engine.stats.spec_decode_num_accepted_tokens,
                         engine.stats.spec_decode_num_draft_tokens)
    assert 0 < accepted < drafted, "some drafts should have been kept and some rejected"
    follow = prompt + first + encode(" And then")
    hits_before = engine.stats.prefix_cache_hits
    second = run(engine, {"b": follow}, {"b": GREEDY}, drafting=False)["b"]
    assert engine.stats.prefix_cache_hits - hits_before >= 16 * ((len(prompt) + 30) // 16)
    assert second == run(engine_for(enable_prefix_caching=False), {"b": follow},
                         {"b": GREEDY}, drafting=False)["b"]


def test_preemption_with_pending_drafts_changes_no_output(encode: Any) -> None:
    """A cache too small for every request at once: requests are preempted while they hold
    drafts, recomputed later, and every output equals the roomy run without drafts."""
    prompts = {f"r{i}": encode(text) for i, text in enumerate(PROMPTS)}
    params = {name: (GREEDY if i % 2 == 0 else SEEDED) for i, name in enumerate(prompts)}
    plain = run(engine_for(), prompts, params, drafting=False)
    tight = engine_for(num_blocks=12)  # 192 tokens for four requests of ~12 + 40
    drafted = run(tight, prompts, {n: scripted(p, plain[n]) for n, p in params.items()},
                  drafting=True)
    assert drafted == plain
    assert tight.stats.num_preemptions > 0
    assert tight.stats.spec_decode_num_accepted_tokens > 0


def test_no_draft_runs_past_max_model_len(encode: Any) -> None:
    """Requests without max_tokens end at the model's length, drafts or not, on the same
    tokens; no step scores a position past it."""
    prompts = {f"r{i}": encode(text) for i, text in enumerate(PROMPTS[:2])}
    limit = max(len(ids) for ids in prompts.values()) + 21
    unbounded = dataclasses.replace(GREEDY, max_tokens=None, ignore_eos=True)
    params = dict.fromkeys(prompts, unbounded)
    plain = run(engine_for(max_model_len=limit), prompts, params, drafting=False)
    engine = engine_for(max_model_len=limit)
    drafted = run(engine, prompts, {n: scripted(p, plain[n]) for n, p in params.items()},
                  drafting=True)
    assert drafted == plain
    for name, ids in prompts.items():
        assert len(ids) + len(plain[name]) == limit

"""The output path with the engine: n > 1 sharing one prefill, stop strings freeing blocks at
once, output kinds through LLM."""

from __future__ import annotations

import random
from typing import Any

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.output.processor import OutputProcessor
from nanoserve.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(str(tiny_model_dir("qwen2")), device="cpu", kv_cache_memory_gb=0.05)


def test_n_samples_equal_separate_seeded_requests_and_prefill_once(llm: LLM) -> None:
    rng = random.Random(5)
    prompt = {"prompt_token_ids": [rng.randrange(3, 49152) for _ in range(200)]}
    params = SamplingParams(n=4, seed=1000, temperature=1.0, max_tokens=8, ignore_eos=True)
    stats = llm.engine.stats
    computed, hits = stats.num_computed_tokens, stats.prefix_cache_hits
    (out,) = llm.generate(prompt, params)
    # the prompt's 12 full blocks are computed once; samples 1..3 reuse them and compute only
    # the 8 tokens of the last, partial block; then 7 decodes each
    assert stats.num_computed_tokens - computed == 200 + 3 * 8 + 4 * 7
    assert stats.prefix_cache_hits - hits == 3 * 192
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    for i, sample in enumerate(out.outputs):
        alone = llm.generate(prompt, SamplingParams(seed=1000 + i, temperature=1.0,
                                                    max_tokens=8, ignore_eos=True))
        assert sample.token_ids == alone[0].outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_stop_string_frees_blocks_in_the_same_step(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    text = llm.generate("Stop here", greedy)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    engine = llm.engine
    processor = OutputProcessor(llm.get_tokenizer())
    ids = llm.get_tokenizer().encode("Stop here")
    (engine_request,) = processor.add_request("s", "Stop here", ids, SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))
    engine.add_request(engine_request[0], ids, engine_request[1])
    steps = 0
    while True:
        result = processor.process(engine.step())
        steps += 1
        if result.to_abort:
            break
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks  # still held...
    for engine_id in result.to_abort:
        engine.abort(engine_id)
    # ...and freed before any further step
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.has_unfinished() and steps < 30
    final = result.outputs[0].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[: text.index(stop)]


def test_output_kinds_through_llm(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    final = llm.generate("kinds", params)[0].outputs[0].text
    pieces = list(llm.stream("kinds", params))
    assert "".join(pieces) == final and len(pieces) > 1
    # n > 1 through generate: every sample finished, each with its own index
    many = llm.generate("kinds", SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=5))[0]
    assert len(many.outputs) == 3 and all(c.finished for c in many.outputs)
    assert RequestOutputKind.FINAL_ONLY == 2

"""EngineCore's `return_progress` (llama-server's `prompt_progress`) on the tiny model: one
PromptProgress per prefill chunk, the last on the output of the first token, the cached part
counted; nothing for requests that did not ask."""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers import make_engine

from nanoserve.engine.core import EngineCore
from nanoserve.protocol import (
    EngineCoreOutput,
    EngineOutputs,
    PromptProgress,
    SchedulerStats,
    decode_message,
    encode,
)
from nanoserve.sampling_params import SamplingParams

CHUNK = 64  # --max-num-batched-tokens
ASKING = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, return_progress=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any) -> EngineCore:
    return make_engine(str(tiny_model_dir("llama")), max_num_batched_tokens=CHUNK)


def run(engine: EngineCore, prompts: dict[str, list[int]],
        params: dict[str, SamplingParams]) -> dict[str, list[EngineCoreOutput]]:
    """Every output of each request, in order."""
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params[request_id])
    outputs: dict[str, list[EngineCoreOutput]] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


def test_one_progress_per_prefill_chunk_the_last_with_the_first_token(
        engine: EngineCore) -> None:
    prompt = random_prompt(1, 300)
    outs = run(engine, {"a": prompt}, {"a": ASKING})["a"]
    progress = [o.prompt_progress for o in outs if o.prompt_progress is not None]
    assert [p.processed for p in progress] == [64, 128, 192, 256, 300]
    assert all(p.total == 300 and p.cache == 0 for p in progress)
    times = [p.time_ms for p in progress]
    assert times == sorted(times) and times[0] >= 0
    # the chunks that sample nothing come alone: no tokens, no finish
    alone = [o for o in outs if o.prompt_progress is not None and o.prompt_progress.processed < 300]
    assert len(alone) == 4
    assert all(o.new_token_ids == [] and o.finish_reason is None for o in alone)
    first_token = next(o for o in outs if o.new_token_ids)
    assert first_token.prompt_progress == progress[-1]
    assert sum(len(o.new_token_ids) for o in outs) == 3 and outs[-1].finish_reason == "length"
    # a repeated prompt: its cached blocks count as processed from the start
    again = run(engine, {"b": prompt}, {"b": ASKING})["b"]
    cached = [o.prompt_progress for o in again if o.prompt_progress is not None]
    assert cached == [PromptProgress(300, 288, 300, cached[0].time_ms)]
    assert again[0].num_cached_tokens == 288 and again[0].new_token_ids


def test_only_the_request_that_asked_reports(engine: EngineCore) -> None:
    prompts = {"asks": random_prompt(2, 150), "quiet": random_prompt(3, 150)}
    outs = run(engine, prompts, {"asks": ASKING, "quiet": SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True)})
    assert [o.prompt_progress.processed for o in outs["asks"]
            if o.prompt_progress is not None][-1] == 150
    assert all(o.prompt_progress is None and o.new_token_ids for o in outs["quiet"])


def test_progress_crosses_the_process_boundary() -> None:
    message = EngineOutputs([EngineCoreOutput("r", [], prompt_progress=PromptProgress(
        300, 16, 64, 5)), EngineCoreOutput("s", [7])], SchedulerStats(), 0.0)
    decoded = decode_message(encode(message))
    assert isinstance(decoded, EngineOutputs)
    assert decoded.outputs == message.outputs

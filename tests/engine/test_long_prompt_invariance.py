"""A long prompt's outputs do not depend on how it was chunked or batched: the default model
(GGUF blocks, float16 KV cache, the tiled prefill attention of csrc/flash_tiles.h), a prompt
spanning several 512-key partitions, prefilled in chunks of 64, 512 or 2048 tokens, alone and
beside another request; seeded sampling with logprobs, compared bit for bit."""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers import make_engine

from nanoserve.sampling_params import SamplingParams

PROMPT_TOKENS = 1500
PARAMS = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=8, logprobs=2)


def outputs(chunk: int, batched: bool) -> dict[str, Any]:
    """Each request's token ids and logprobs, the long one's prompt chunked by `chunk`."""
    engine = make_engine(None, quantization="gguf", max_num_batched_tokens=chunk,
                         enable_prefix_caching=False)
    rng = random.Random(0)
    long_prompt = [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]
    engine.add_request("long", long_prompt, PARAMS)
    if batched:
        engine.add_request("short", long_prompt[:40], PARAMS)
    got: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            entry = got.setdefault(out.request_id, {"ids": [], "logprobs": []})
            entry["ids"].extend(out.new_token_ids)
            entry["logprobs"].extend((e.token_id, e.logprob, e.top_ids, e.top_logprobs)
                                     for e in out.new_logprobs or ())
    return got


@pytest.mark.slow
def test_a_long_prompt_gives_the_same_bits_whatever_its_chunks_and_batch() -> None:
    reference = outputs(2048, batched=False)["long"]
    assert len(reference["ids"]) == PARAMS.max_tokens
    for chunk in (64, 512):
        assert outputs(chunk, batched=False)["long"] == reference, f"chunks of {chunk}"
    for chunk in (64, 2048):
        assert outputs(chunk, batched=True)["long"] == reference, f"batched, chunks of {chunk}"

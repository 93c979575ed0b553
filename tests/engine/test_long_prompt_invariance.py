"""A long prompt's outputs do not depend on how it was chunked or batched: the default model
(GGUF blocks, a float16 or int8 KV cache, the tiled prefill attention of csrc/flash_tiles.h
and csrc/run_attend.h), a prompt
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


def outputs(chunk: int, batched: bool, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Each request's token ids and logprobs, the long one's prompt chunked by `chunk`."""
    engine = make_engine(None, quantization="gguf", max_num_batched_tokens=chunk,
                         enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
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
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_long_prompt_gives_the_same_bits_whatever_its_chunks_and_batch(
        kv_cache_dtype: str) -> None:
    """auto is float16 here (GGUF weights)."""
    reference = outputs(2048, batched=False, kv_cache_dtype=kv_cache_dtype)["long"]
    assert len(reference["ids"]) == PARAMS.max_tokens
    for chunk in (64, 512):
        got = outputs(chunk, batched=False, kv_cache_dtype=kv_cache_dtype)["long"]
        assert got == reference, f"chunks of {chunk}"
    for chunk in (64, 2048):
        got = outputs(chunk, batched=True, kv_cache_dtype=kv_cache_dtype)["long"]
        assert got == reference, f"batched, chunks of {chunk}"


def paced_run(pacing: float) -> tuple[dict[str, Any], list[int]]:
    """A stream decoding, then the long prompt beside it, with `--prefill-pacing` as given:
    each request's tokens and logprobs, and the long prompt's chunk in each step."""
    from nanoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from nanoserve.engine.build import build_engine_core

    engine = build_engine_core(EngineConfig(
        model=ModelConfig(device="cpu", dtype="float32", quantization="gguf"),
        cache=CacheConfig(kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, prefill_pacing=pacing)))
    rng = random.Random(1)
    stream = SamplingParams(temperature=0.8, seed=3, max_tokens=120, logprobs=1)
    engine.add_request("stream", [rng.randrange(1000, 40000) for _ in range(30)], stream)
    got: dict[str, Any] = {}

    def step() -> None:
        for out in engine.step():
            entry = got.setdefault(out.request_id, {"ids": [], "logprobs": []})
            entry["ids"].extend(out.new_token_ids)
            entry["logprobs"].extend((e.token_id, e.logprob) for e in out.new_logprobs or ())

    for _ in range(6):  # the stream's prompt, then decode-only steps
        step()
    engine.add_request("long", [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)],
                       PARAMS)
    chunks = []
    while "long" not in got:
        long = engine.scheduler.requests["long"]
        before, decoded = long.num_computed_tokens, len(got["stream"]["ids"])
        step()
        chunks.append(long.num_computed_tokens - before)
        assert len(got["stream"]["ids"]) == decoded + 1, "the stream got no token this step"
    while engine.has_unfinished():
        step()
    return got, chunks


@pytest.mark.slow
def test_prefill_pacing_cuts_a_long_prompt_beside_a_stream_and_changes_no_bit() -> None:
    """`--prefill-pacing`: beside a decoding stream the long prompt goes in chunks far below the
    512-token budget (at least the pacer's floor), the stream gets a token every step, and
    every token and logprob of both requests equals an unpaced run's."""
    from nanoserve.engine.prefill_pacer import MIN_CHUNK_TOKENS

    paced, chunks = paced_run(2.0)
    unpaced, plain = paced_run(0)
    assert plain[:2] == [511, 511]  # the budget less the stream's token
    assert len(chunks) > len(plain) and max(chunks[:-1]) < 512
    assert min(chunks[:-2]) >= MIN_CHUNK_TOKENS
    assert paced == unpaced and len(paced["long"]["ids"]) == PARAMS.max_tokens

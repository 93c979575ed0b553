"""nanoserve computes what transformers computes: prefill logits, and greedy tokens under any
batching: all prompts together (chunked prefills, a cache small enough to preempt) or one by one.
"""

from __future__ import annotations

import random
from functools import cache
from typing import Any

import pytest
import torch
from conftest import TINY_FAMILIES
from helpers import hf_greedy, hf_model, make_engine, run_to_completion

from nanoserve.engine.core import EngineCore
from nanoserve.model.attention import PrefillChunk, SdpaBackend, SdpaMetadata
from nanoserve.model.hybrid_layers import HybridStates
from nanoserve.model.loader import default_model_path
from nanoserve.sampling_params import SamplingParams

PROMPT_LENGTHS = (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 64, 100, 150, 211, 256, 300)
NUM_NEW_TOKENS = 12
# The default model decodes fewer: its decode steps are most of the test's minute (transformers'
# reference and ours, token by token). 8 still read decode-written KV entries and cross block
# boundaries (15 + 8, 31 + 8); with 8, a cache of 32 blocks (the fewest max_model_len=512 fits)
# preempts 3 times where 36 preempted once (6 tokens: none). The tiny models decode all 12.
DEFAULT_MODEL_NEW_TOKENS = 8
DEFAULT_MODEL_NUM_BLOCKS = 32


def random_prompts(vocab_size: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"p{n}": [rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS}


@torch.inference_mode()
def prefill_logits(engine: EngineCore, prompt_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the paged prefill path (blocks 0, 1, ...); a
    hybrid model's (Qwen3.5) DeltaNet states from zeros, in slot 0 of its pool."""
    runner = engine.runner
    n = len(prompt_ids)
    attention = SdpaBackend(block_size=runner.block_size, num_kv_heads=runner.num_kv_heads,
                            num_blocks=runner.num_blocks, device=runner.device)
    meta = SdpaMetadata(cache_index=torch.arange(n), prefills=[PrefillChunk(0, n, n)])
    extra: dict[str, Any] = {}
    pool = runner.state_pool
    if pool is not None:
        pool.conv[0].zero_()
        pool.ssm[0].zero_()
        extra["states"] = HybridStates(pool.conv, pool.ssm, torch.tensor([0], dtype=torch.int32),
                                       torch.tensor([0, n], dtype=torch.int32),
                                       torch.full((n,), -1, dtype=torch.int32))
    hidden = runner.plan.forward(torch.tensor(prompt_ids), torch.arange(n), runner.kv_caches,
                                 attention, meta, **extra)
    return runner.model.compute_logits(hidden)


@torch.inference_mode()
def assert_logits_match(engine: EngineCore, reference: Any, prompts: list[list[int]]) -> None:
    for ids in prompts:
        ours = prefill_logits(engine, ids)
        theirs = reference(torch.tensor([ids])).logits[0].float()
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert rel < 1e-4, f"prompt of {len(ids)} tokens: relative logit error {rel:.2e}"


def assert_tokens_match(model: str, reference: Any, vocab_size: int,
                        num_new: int = NUM_NEW_TOKENS, num_blocks: int = 36) -> None:
    prompts = random_prompts(vocab_size)
    expected = {rid: hf_greedy(reference, ids, num_new) for rid, ids in prompts.items()}
    greedy = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)

    # one by one, default budgets
    alone = make_engine(model)
    for rid, ids in prompts.items():
        got = run_to_completion(alone, {rid: ids}, greedy)[rid]
        assert got == expected[rid], f"{rid} alone differs from transformers"

    # all together: 48-token budget (every prompt over 48 tokens is chunked) and 36 (or 32)
    # blocks of 16 for ~1,400 tokens of work, so requests are preempted and recomputed
    together = make_engine(model, num_blocks=num_blocks, max_num_batched_tokens=48,
                           max_model_len=512)
    got_all = run_to_completion(together, prompts, greedy)
    assert together.stats.num_preemptions > 0, "the small cache should have forced preemption"
    for rid in prompts:
        assert got_all[rid] == expected[rid], f"{rid} batched differs from transformers"
    assert together.kv_cache.num_free_blocks == num_blocks


@cache
def _tiny(family: str, path: str) -> tuple[Any, int]:
    reference = hf_model(path)
    return reference, reference.config.vocab_size


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_prefill_logits_match_transformers(family: str, tiny_model_dir: Any) -> None:
    path = str(tiny_model_dir(family))
    reference, vocab = _tiny(family, path)
    prompts = random_prompts(vocab, seed=1)
    assert_logits_match(make_engine(path), reference,
                        [prompts["p1"], prompts["p33"], prompts["p300"]])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_greedy_tokens_match_transformers(family: str, tiny_model_dir: Any) -> None:
    path = str(tiny_model_dir(family))
    reference, vocab = _tiny(family, path)
    assert_tokens_match(path, reference, vocab)


@pytest.fixture(scope="module")
def smollm_reference() -> Any:
    return hf_model(default_model_path())


@pytest.mark.slow
def test_default_model_prefill_logits_match_transformers(smollm_reference: Any) -> None:
    engine = make_engine(None)
    prompts = random_prompts(engine.model_info.arch.vocab_size, seed=2)
    assert_logits_match(engine, smollm_reference, [prompts["p7"], prompts["p300"]])


@pytest.mark.slow
def test_default_model_greedy_tokens_match_transformers(smollm_reference: Any) -> None:
    assert_tokens_match(str(default_model_path()), smollm_reference,
                        smollm_reference.config.vocab_size, DEFAULT_MODEL_NEW_TOKENS,
                        DEFAULT_MODEL_NUM_BLOCKS)

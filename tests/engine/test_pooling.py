"""Prefill-only pooling requests on a real (tiny) model: vectors equal to transformers', batch
invariant, scheduled beside generation without changing it, and gone once answered."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import hf_model, run_to_completion

from nanoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from nanoserve.engine.build import build_engine_core
from nanoserve.engine.core import EngineCore
from nanoserve.entrypoints.llm import LLM
from nanoserve.pooling_params import PoolingParams
from nanoserve.protocol import (
    EngineCoreOutput,
    EngineOutputs,
    SchedulerStats,
    decode_message,
    encode,
)
from nanoserve.sampling_params import SamplingParams

# prompts of varied lengths: with a 48-token budget the long ones prefill in several chunks
PROMPTS = [[(7 * i + 3 * j) % 4000 + 3 for j in range(n)]
           for i, n in enumerate((5, 17, 40, 64, 9, 100, 33, 2))]
MAX_COSINE_GAP = 1e-5


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: Any) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def reference(llama_dir: str) -> Any:
    return hf_model(llama_dir)


def make_engine(model: str, pooling: str = "last", *, max_num_batched_tokens: int = 48,
                enable_prefix_caching: bool = True, num_blocks: int | None = None,
                max_model_len: int | None = None) -> EngineCore:
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=model, device="cpu", dtype="float32", quantization="none",
                          pooling=pooling, max_model_len=max_model_len),
        cache=CacheConfig(num_blocks=num_blocks, kv_cache_memory_bytes=16 << 20,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens)))


def pool(engine: EngineCore, prompts: dict[str, list[int]],
         params: PoolingParams | None = None) -> dict[str, EngineCoreOutput]:
    """Add every prompt as a pooling request, step until done; each one's output."""
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, SamplingParams(), pooling_params=params
                           or PoolingParams())
    outputs: dict[str, EngineCoreOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    return outputs


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@torch.inference_mode()
def hf_hidden(model: Any, ids: list[int]) -> np.ndarray:
    """transformers' final normed hidden states [len(ids), hidden]."""
    return model.model(torch.tensor([ids])).last_hidden_state[0].numpy()


@pytest.mark.parametrize("method", ["last", "mean"])
def test_vectors_equal_transformers_and_are_normalized(llama_dir: str, reference: Any,
                                                       method: str) -> None:
    outs = pool(make_engine(llama_dir, method), {str(i): p for i, p in enumerate(PROMPTS)})
    for i, ids in enumerate(PROMPTS):
        out = outs[str(i)]
        assert out.new_token_ids == [] and out.finish_reason == "stop"
        assert out.pooled is not None and out.pooled.dtype == np.float32
        assert out.pooled.shape == (64,)
        assert abs(float(np.linalg.norm(out.pooled)) - 1.0) < 1e-5
        hidden = hf_hidden(reference, ids)
        expected = hidden[-1] if method == "last" else hidden.mean(0)
        assert cosine(out.pooled, expected) >= 1 - MAX_COSINE_GAP, (method, i)


@pytest.mark.parametrize("method", ["last", "mean"])
def test_vectors_are_batch_invariant(llama_dir: str, method: str) -> None:
    """One input alone, then inside a batch of 8 chunked differently (a 48-token budget)."""
    target = PROMPTS[5]  # 100 tokens: three chunks alone, more inside the batch
    alone = pool(make_engine(llama_dir, method), {"t": target})["t"].pooled
    batch = {f"b{i}": p for i, p in enumerate(PROMPTS[:7])} | {"t": target}
    batched = pool(make_engine(llama_dir, method), batch)["t"].pooled
    assert alone is not None and batched is not None
    assert cosine(alone, batched) >= 1 - MAX_COSINE_GAP
    # the check can fail: a different input is far away
    assert cosine(alone, pool(make_engine(llama_dir, method),
                              {"o": PROMPTS[3]})["o"].pooled) < 0.99  # type: ignore[arg-type]


def test_pooling_beside_generation_leaves_its_tokens_unchanged(llama_dir: str) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True)]  # unseeded
    prompts = {f"g{i}": PROMPTS[i + 1] for i in range(3)}

    def generate(engine: EngineCore, with_pooling: bool) -> dict[str, list[int]]:
        for (request_id, ids), p in zip(prompts.items(), params, strict=True):
            if with_pooling:  # an embedding queued before each generating request
                engine.add_request(f"e-{request_id}", PROMPTS[5], SamplingParams(),
                                   pooling_params=PoolingParams())
            engine.add_request(request_id, ids, p)
        tokens: dict[str, list[int]] = {r: [] for r in prompts}
        num_steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id in tokens:
                    tokens[out.request_id] += out.new_token_ids
                else:
                    assert out.pooled is not None and out.new_token_ids == []
            num_steps += 1
            if with_pooling and num_steps == 4:  # and more while they decode
                for j in range(3):
                    engine.add_request(f"late{j}", PROMPTS[j + 3], SamplingParams(),
                                       pooling_params=PoolingParams())
        return tokens

    alone = generate(make_engine(llama_dir), with_pooling=False)
    beside = generate(make_engine(llama_dir), with_pooling=True)
    assert beside == alone
    assert all(len(t) == 12 for t in alone.values())


def test_blocks_and_slots_are_freed_after_pooling(llama_dir: str) -> None:
    engine = make_engine(llama_dir, "mean", num_blocks=40)
    kv = engine.kv_cache
    pool(engine, {str(i): p for i, p in enumerate(PROMPTS)})
    assert kv.num_free_blocks == 40 and all(b.ref_count == 0 for b in kv.pool.blocks)
    assert kv.req_blocks == {} and engine.scheduler.requests == {}
    assert sorted(engine.scheduler.free_slots) == list(range(64))
    assert engine.executor.worker.pooler.sums == {}  # type: ignore[attr-defined]
    assert engine.stats.num_running == 0 and engine.stats.kv_blocks_in_use == 0


def test_preempted_pooling_request_still_gets_the_right_vector(llama_dir: str,
                                                               reference: Any) -> None:
    """A cache too small for two long generations and the pooling requests admitted after
    them: the newest running requests (pooling ones among them) are preempted, recomputed."""
    engine = make_engine(llama_dir, "mean", num_blocks=12, enable_prefix_caching=False)
    for g in range(2):
        engine.add_request(f"g{g}", PROMPTS[2][:30], SamplingParams(
            temperature=0.0, max_tokens=70, ignore_eos=True))
    for _ in range(3):
        engine.step()
    outs = pool(engine, {str(i): p for i, p in enumerate(PROMPTS)})
    assert engine.stats.num_preemptions > 0
    for i, ids in enumerate(PROMPTS):
        pooled = outs[str(i)].pooled
        assert pooled is not None
        assert cosine(pooled, hf_hidden(reference, ids).mean(0)) >= 1 - MAX_COSINE_GAP
    assert engine.kv_cache.num_free_blocks == 12


def test_prefix_cache_serves_last_pooling_only(llama_dir: str) -> None:
    for method, expect_hits in (("last", True), ("mean", False)):
        engine = make_engine(llama_dir, method)
        first = pool(engine, {"a": PROMPTS[5]})["a"]
        second = pool(engine, {"b": PROMPTS[5]})["b"]
        assert first.num_cached_tokens == 0
        assert (second.num_cached_tokens == 96) is expect_hits, method
        assert first.pooled is not None and second.pooled is not None
        assert cosine(first.pooled, second.pooled) >= 1 - MAX_COSINE_GAP


def test_score_task_returns_the_lm_heads_logits(llama_dir: str, reference: Any) -> None:
    ids = [11, 12]
    outs = pool(make_engine(llama_dir), {"s": PROMPTS[2]},
                PoolingParams(task="score", logit_token_ids=ids))
    with torch.inference_mode():
        logits = reference(torch.tensor([PROMPTS[2]])).logits[0, -1].numpy()
    assert outs["s"].pooled is not None
    np.testing.assert_allclose(outs["s"].pooled, logits[ids], rtol=1e-4, atol=1e-4)


def test_dimensions_truncate_then_normalize(llama_dir: str) -> None:
    engine = make_engine(llama_dir)
    raw = pool(engine, {"r": PROMPTS[1]}, PoolingParams(normalize=False))["r"].pooled
    cut = pool(engine, {"c": PROMPTS[1]}, PoolingParams(dimensions=16))["c"].pooled
    assert raw is not None and cut is not None and cut.shape == (16,)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3  # not normalized
    np.testing.assert_allclose(cut, raw[:16] / np.linalg.norm(raw[:16]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="dimensions must be at most the model's"):
        engine.add_request("x", [5], SamplingParams(), pooling_params=PoolingParams(
            dimensions=65))
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="classify")


def test_an_input_may_fill_the_context_but_not_pass_it(llama_dir: str) -> None:
    engine = make_engine(llama_dir, max_model_len=64)
    assert pool(engine, {"full": PROMPTS[3]})["full"].pooled is not None  # 64 tokens
    with pytest.raises(ValueError, match="the input has 100 tokens, but max_model_len is 64"):
        engine.add_request("long", PROMPTS[5], SamplingParams(),
                           pooling_params=PoolingParams())
    assert not engine.has_unfinished()


def test_pooled_vectors_cross_the_process_boundary(llama_dir: str) -> None:
    engine = make_engine(llama_dir)
    direct = pool(engine, {"d": PROMPTS[2]})["d"].pooled
    worker = engine.executor.worker  # type: ignore[attr-defined]
    from nanoserve.engine.executor import InProcessExecutor

    engine.executor = InProcessExecutor(worker, serialize=True)
    out = pool(engine, {"s": PROMPTS[2]})["s"]
    message = decode_message(encode(EngineOutputs([out], SchedulerStats(), 0.0)))
    assert isinstance(message, EngineOutputs)
    back = message.outputs[0].pooled
    assert direct is not None and back is not None and back.dtype == np.float32
    assert cosine(direct, back) >= 1 - MAX_COSINE_GAP
    assert np.array_equal(back, out.pooled)  # type: ignore[arg-type]


def test_llm_embed_takes_text_and_token_ids_alike(llama_dir: str) -> None:
    llm = LLM(llama_dir, device="cpu", quantization="none", kv_cache_memory_gb=0.02)
    text = "The quick brown fox jumps over the lazy dog."
    by_text, by_ids = llm.embed([text, {"prompt_token_ids": llm.tokenizer.encode(text)}])
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert cosine(by_text.outputs.data, by_ids.outputs.data) >= 1 - MAX_COSINE_GAP
    assert len(by_text.outputs.embedding) == 64
    other = llm.embed("Something else entirely, about databases.")[0]
    assert cosine(by_text.outputs.data, other.outputs.data) < 0.99
    # generation afterwards is as before
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert run_to_completion(llm.engine, {"g": [5, 6, 7]}, greedy)["g"] == run_to_completion(
        make_engine(llama_dir), {"g": [5, 6, 7]}, greedy)["g"]

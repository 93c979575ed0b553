"""Qwen3.5 hybrids (Gated DeltaNet layers, three for every gated full-attention layer) compute
what transformers computes, and their DeltaNet states behave as KV blocks do: prefill logits,
greedy tokens alone, batched, in chunks of several sizes and through preemption, seeded
logprobs the same in every batching, and a prefix cache that restores the exact states.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import write_tiny_checkpoint
from gguf_writing import write_qwen35_gguf
from helpers import hf_greedy, hf_model, make_engine, run_to_completion, seeded_logprob_run
from test_equivalence import prefill_logits

from nanoserve.sampling_params import SamplingParams

VOCAB = 49152  # the default model's tokenizer
# dense: value heads twice the key heads, conv 4; "wide": as many value as key heads, conv 3
# and other head counts; moe: a shared expert and 4 routed, top 2
SHAPES: dict[str, dict[str, Any]] = {
    "dense": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32),
    "wide": dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=8,
                 linear_value_head_dim=32, linear_conv_kernel_dim=3, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64),
    "moe": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=48),
    # Qwen3-Next: the same layers, in_proj_qkvz / in_proj_ba fused key head by key head; MoE
    # but for layer 1 (mlp_only_layers)
    "next": dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, linear_conv_kernel_dim=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 mlp_only_layers=[1]),
}


def tiny_qwen35_config(kind: str) -> Any:
    """8 layers, every 4th full attention (layers 3 and 7), over the default tokenizer."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, initializer_range=0.05, tie_word_embeddings=False,
                  **SHAPES[kind])
    config_class = {"moe": transformers.Qwen3_5MoeTextConfig,
                    "next": transformers.Qwen3NextConfig}.get(kind, transformers.Qwen3_5TextConfig)
    return config_class(**common)


@pytest.fixture(scope="session")
def qwen35_dir(tmp_path_factory: pytest.TempPathFactory,
               default_tokenizer: Any) -> Any:
    """kind -> a directory holding that tiny Qwen3.5 checkpoint (written once)."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-qwen35-{kind}"),
                                               tiny_qwen35_config(kind), default_tokenizer, 35)
        return made[kind]

    return make


@pytest.fixture(scope="session")
def qwen35_source(qwen35_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(kind, format) -> the tiny checkpoint's directory ("safetensors"), or the same model as
    llama.cpp's converter writes it ("gguf": float32; "q8_0": Q8_0 matmul weights, run by the
    int8 kernels), and the directory transformers reads as the reference."""
    import gguf

    made: dict[tuple[str, str], Path] = {}

    def make(kind: str, fmt: str = "safetensors") -> tuple[str, str]:
        directory = qwen35_dir(kind)
        if fmt == "safetensors":
            return str(directory), str(directory)
        if (kind, fmt) not in made:
            qtype = gguf.GGMLQuantizationType.Q8_0 if fmt == "q8_0" \
                else gguf.GGMLQuantizationType.F32
            model = reference(str(directory))
            path = tmp_path_factory.mktemp(f"qwen35-{kind}-{fmt}") / "model.gguf"
            made[(kind, fmt)] = write_qwen35_gguf(model, model.config, path, qtype=qtype)
        return str(made[(kind, fmt)]), str(directory)

    return make


@cache
def reference(path: str) -> Any:
    return hf_model(path)


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.mark.parametrize(("kind", "fmt"), [(kind, "safetensors") for kind in SHAPES]
                         + [("dense", "gguf"), ("moe", "gguf")])
def test_prefill_logits_match_transformers(kind: str, fmt: str, qwen35_source: Any) -> None:
    """Safetensors, and the same written as llama.cpp's GGUF (its tiled value heads read as
    they are, its norms stored as 1 + w)."""
    path, directory = qwen35_source(kind, fmt)
    engine = make_engine(path)
    for n in (1, 33, 300):  # 300: past several 64-token chunks of transformers' chunked form
        ids = random_ids(n, seed=n)
        ours = prefill_logits(engine, ids)
        theirs = reference(directory)(torch.tensor([ids])).logits[0].float()
        rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert rel < 1e-4, f"{kind}, {n} tokens: relative logit error {rel:.2e}"


PROMPT_LENGTHS = (1, 5, 16, 17, 40, 64, 100, 150)
NUM_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.mark.parametrize(("kind", "fmt"), [("dense", "safetensors"), ("moe", "safetensors"),
                                           ("next", "safetensors"), ("dense", "gguf")])
def test_greedy_tokens_match_transformers_alone_batched_chunked_preempted(
        kind: str, fmt: str, qwen35_source: Any) -> None:
    path, directory = qwen35_source(kind, fmt)
    prompts = {f"p{n}": random_ids(n, seed=100 + n) for n in PROMPT_LENGTHS}
    expected = {rid: hf_greedy(reference(directory), ids, NUM_NEW)
                for rid, ids in prompts.items()}
    alone = make_engine(path)
    for rid, ids in prompts.items():
        assert run_to_completion(alone, {rid: ids}, GREEDY)[rid] == expected[rid], rid
    # all together, in chunks of 7, 16 and 48 tokens; the smallest cache preempts
    for budget, num_blocks in ((7, 40), (16, 40), (48, 17)):
        together = make_engine(path, num_blocks=num_blocks, max_num_batched_tokens=budget,
                               max_model_len=256)
        got = run_to_completion(together, prompts, GREEDY)
        for rid in prompts:
            assert got[rid] == expected[rid], f"{rid} in chunks of {budget} differs"
        if num_blocks == 17:
            assert together.stats.num_preemptions > 0, "the small cache should preempt"


@pytest.mark.parametrize(("kind", "fmt", "quantization"),
                         [("wide", "safetensors", "int8"), ("dense", "q8_0", "gguf")])
def test_seeded_outputs_and_logprobs_equal_across_chunks_and_batches(
        kind: str, fmt: str, quantization: str, qwen35_source: Any) -> None:
    """Bit for bit, so on int8 weights (quantized at load, or a Q8_0 GGUF's): the quantized
    matmuls' bits do not depend on the batch (float32 PyTorch matmuls' may: the exact path is
    held to transformers instead)."""
    path, _ = qwen35_source(kind, fmt)
    prompts = {f"p{n}": random_ids(n, seed=200 + n) for n in (3, 37, 90)}
    alone = {rid: seeded_logprob_run(make_engine(path, quantization=quantization), {rid: ids})[rid]
             for rid, ids in prompts.items()}
    for budget in (5, 32, 512):
        together = seeded_logprob_run(make_engine(path, max_num_batched_tokens=budget,
                                           quantization=quantization), prompts)
        assert together == alone, f"chunks of {budget} changed a token or a logprob"


def test_a_prefix_hit_restores_the_exact_states(qwen35_dir: Any) -> None:
    """A conversation sent turn by turn: each turn's prompt is the last one, its answer and a
    new message. Every turn after the first finds most of its prompt cached, and gives the
    tokens and logprobs a server without a prefix cache gives (bit for bit: int8 weights)."""
    path = str(qwen35_dir("dense"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    warm = make_engine(path, quantization="int8")
    cold = make_engine(path, enable_prefix_caching=False, quantization="int8")
    history = random_ids(150, seed=300)
    for turn in range(3):
        runs = []
        for engine in (warm, cold):
            engine.add_request(f"t{turn}", list(history), params)
            tokens, logprobs, cached = [], [], 0
            while engine.has_unfinished():
                for out in engine.step():
                    tokens += out.new_token_ids
                    logprobs.append(out.new_logprobs)
                    cached = out.num_cached_tokens
            runs.append((tokens, logprobs, cached))
        (tokens, logprobs, cached), (cold_tokens, cold_logprobs, cold_cached) = runs
        assert (tokens, logprobs) == (cold_tokens, cold_logprobs), f"turn {turn}"
        assert cold_cached == 0
        if turn:
            assert cached >= len(history) - 40, f"turn {turn}: {cached} of {len(history)}"
        history += tokens + random_ids(20, seed=301 + turn)


def test_prefix_hits_end_at_snapshots_and_snapshots_are_bounded(qwen35_dir: Any) -> None:
    """A second conversation sharing only a long first part finds it up to the last snapshot
    before they diverge (every --mamba-block-size tokens); snapshots never outnumber their
    slots, and go when their blocks are evicted."""
    path = str(qwen35_dir("dense"))
    engine = make_engine(path, num_blocks=64)
    states = engine.state_snapshots
    assert states is not None
    shared = random_ids(600, seed=400)
    run_to_completion(engine, {"a": shared + random_ids(30, seed=401)}, GREEDY)
    engine.add_request("b", shared + random_ids(30, seed=402), GREEDY)
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            cached = out.num_cached_tokens
    assert cached == 512  # the last multiple of 256 before token 600
    assert len(states.by_hash) + len(states.free) == engine.runner.state_pool.num_slots - 64
    # a flood of other prompts evicts the blocks, and their snapshots with them
    for i in range(6):
        run_to_completion(engine, {f"x{i}": random_ids(300, seed=500 + i)}, GREEDY)
    hashes = set(engine.kv_cache.pool.cached)
    assert all(h in hashes for h in states.by_hash)


def test_n_samples_fork_the_leaders_states(qwen35_dir: Any) -> None:
    """n > 1: the samples after the first wait for its prompt, then start from the state its
    prompt's last full block left (a snapshot) and compute only the rest; each sample is what
    it is alone."""
    path = str(qwen35_dir("dense"))
    ids = random_ids(75, seed=600)

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True,
                              logprobs=1)

    engine = make_engine(path, quantization="int8")
    for i in range(3):
        engine.add_request(f"s{i}", ids, params(i), prefill_leader="s0" if i else None)
    got: dict[str, list[Any]] = {f"s{i}": [] for i in range(3)}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append((out.new_token_ids, out.new_logprobs))
            cached[out.request_id] = out.num_cached_tokens
    assert cached == {"s0": 0, "s1": 64, "s2": 64}  # 75 tokens: 4 full blocks before the last
    for i in range(3):
        alone = make_engine(path, quantization="int8")
        alone.add_request("a", ids, params(i))
        mine = []
        while alone.has_unfinished():
            mine += [(o.new_token_ids, o.new_logprobs) for o in alone.step()]
        assert got[f"s{i}"] == mine, f"sample {i}"

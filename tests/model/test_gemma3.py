"""Gemma 3 computes what transformers computes: a tiny random Gemma3ForCausalLM checkpoint
(sandwich norms stored as w and run as 1 + w, GELU-tanh gate, embedding x sqrt(hidden), q/k
norms, windowed and global layers with their own RoPE bases, a query scale of its own) equals
transformers in prefill logits and in greedy tokens alone and batched (chunked, preempted),
with prompts far past its window; and the real Gemma 3 270M from PyPI (a GGUF file of Q5_0,
Q4_K, Q6_K and Q8_0 tensors) does the same on its exact path, for prompts shorter and longer
than its 512-token window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import _spread_norm_weights
from helpers import hf_greedy, hf_model, make_engine, run_to_completion
from test_equivalence import assert_logits_match, assert_tokens_match

from nanoserve.model.arch import FULL, SLIDING, ArchConfig
from nanoserve.sampling_params import SamplingParams

TINY_WINDOW = 16


def tiny_gemma3_config() -> Any:
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.05, sliding_window=TINY_WINDOW, query_pre_attn_scalar=24,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
        rope_parameters={FULL: {"rope_type": "default", "rope_theta": 1000000.0},
                         SLIDING: {"rope_type": "default", "rope_theta": 10000.0}})


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    import transformers

    path = tmp_path_factory.mktemp("tiny-gemma3")
    torch.manual_seed(1234)
    model = transformers.Gemma3ForCausalLM(tiny_gemma3_config())
    _spread_norm_weights(model)  # 1 + w of 1.5-2.5: a norm run as plain w would show
    model.save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


def test_config_reads_gemma3_layers(tiny_gemma3_dir: Path) -> None:
    import json

    arch = ArchConfig.from_hf_config(json.loads((tiny_gemma3_dir / "config.json").read_text()))
    assert arch.family == "gemma3" and arch.has_sandwich_norms and arch.scales_embedding
    assert [arch.layer_window(i) for i in range(6)] == [16, 16, 0, 16, 16, 0]
    assert arch.rope_theta == 1e6 and arch.rope_local_theta == 1e4
    assert arch.attention_scale == pytest.approx(24 ** -0.5)


def test_tiny_gemma3_equals_transformers(tiny_gemma3_dir: Path) -> None:
    reference = hf_model(tiny_gemma3_dir)
    engine = make_engine(tiny_gemma3_dir)
    assert_logits_match(engine, reference, [[5, 17, 300, 4000] * k for k in (1, 9, 40)])
    assert_tokens_match(str(tiny_gemma3_dir), reference, 49152)


def test_tiny_gemma3_quantized_path_stays_close(tiny_gemma3_dir: Path) -> None:
    """The fused op table (int8 weights) runs Gemma's layer too: greedy text close to the
    exact path's (int8 rounding may flip a near-tie late in a random model's output)."""
    prompts = {f"p{n}": [(7 * i + n) % 49000 + 3 for i in range(n)] for n in (5, 40, 90)}
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    exact = run_to_completion(make_engine(tiny_gemma3_dir), prompts, greedy)
    engine = make_engine(tiny_gemma3_dir, quantization="int8")
    assert engine.runner.plan.use_fused_ops in (None, True)
    quantized = run_to_completion(engine, prompts, greedy)
    assert engine.runner.plan.use_fused_ops
    assert sum(quantized[r][0] == exact[r][0] for r in prompts) >= 2


# -- the real model (conftest's gemma_270m_gguf: skipped without its PyPI packages) ----------
@pytest.mark.slow
def test_gemma3_270m_greedy_equals_transformers(gemma_270m_gguf: Path) -> None:
    """--quantization none on the real GGUF: greedy tokens equal transformers' for prompts
    shorter and longer than the 512-token window, alone and batched (chunks of 256)."""
    reference = hf_model(gemma_270m_gguf)
    prompts = {"short": [2, 818, 5279, 529, 7001, 563],  # "<bos>The capital of France is"
               "long": [2] + [(37 * i) % 20000 + 300 for i in range(700)],
               "window": [2] + [(11 * i) % 30000 + 500 for i in range(530)]}
    num_new = 6
    expected = {rid: hf_greedy(reference, ids, num_new) for rid, ids in prompts.items()}
    greedy = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    # one engine (no prefix cache: the batched run computes every prompt again); a block holds
    # 3 layers: 128 for the global group's 2,048 tokens, 5 x 33 for the windowed groups
    engine = make_engine(gemma_270m_gguf, max_model_len=2048, num_blocks=400,
                         max_num_batched_tokens=256, enable_prefix_caching=False)
    for rid, ids in prompts.items():
        assert run_to_completion(engine, {rid: ids}, greedy)[rid] == expected[rid], rid
    assert run_to_completion(engine, prompts, greedy) == expected


def test_a_long_context_holds_the_global_layers_blocks_and_a_window(
        tmp_path: Path, default_tokenizer: Any) -> None:
    """Gemma's five windowed layers of six give back the blocks that fall out of their window
    (KV layer groups, model/kv_groups.py): a 1,500-token context, while it decodes, holds at
    most a quarter of the blocks it would without windows (measured from the KV-cache
    manager), and its greedy tokens still equal transformers'."""
    import transformers

    config = tiny_gemma3_config()
    config.layer_types = [SLIDING] * 5 + [FULL]
    config.max_position_embeddings = 2048
    torch.manual_seed(99)
    model = transformers.Gemma3ForCausalLM(config)
    _spread_norm_weights(model)
    model.save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    prompt = [(13 * i) % 40000 + 5 for i in range(1500)]
    expected = hf_greedy(hf_model(tmp_path), prompt, 5)

    engine = make_engine(tmp_path, max_num_batched_tokens=256)
    kv = engine.kv_cache
    assert kv.group_windows == (TINY_WINDOW,) * 5 + (0,)  # a block holds one layer
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=5,
                                                      ignore_eos=True))
    tokens: list[int] = []
    held = 0  # the most blocks held while the context decodes (a prefill chunk's step holds
    while engine.has_unfinished():  # its window plus the chunk in each windowed group)
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        if len(tokens) > 1:  # a decode step after the prompt's last chunk
            held = max(held, kv.num_blocks - kv.num_free_blocks)
    assert tokens == expected
    without_windows = -(-(len(prompt) + 5) // kv.block_size) * 6  # every layer, every block
    assert held <= 0.25 * without_windows, (held, without_windows)

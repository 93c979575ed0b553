"""Sliding-window attention (a layer that attends only its last `window` keys, as Gemma 3's
local layers and Mistral do) in both attention backends: the paged kernel against float64 over
the window for every cache type and head layout, across tile (32), block and partition (512)
edges; a prefill chunk's rows attended together with the bits each gets alone; and the gather +
SDPA backend against the kernel's on a mixed step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from step_inputs import make_step_input
from test_paged_attention import (
    chunk_case,
    plain_reference,
    random_case,
    relative_error,
    widened,
    with_cache_dtype,
)

from nanoserve.model.arch import ArchConfig
from nanoserve.model.attention import (
    CpuPagedBackend,
    SdpaBackend,
    dequantize_kv_rows,
    quantize_kv_rows,
)
from nanoserve.model.attention.cpu_paged import decode_attention

# contexts about the edges of tiles (32 keys), blocks (16) and partitions (512)
CONTEXTS = [1, 31, 32, 33, 511, 512, 513, 545, 1100]


def windowed_reference(case: tuple[torch.Tensor, ...], window: int,
                       q_rounded: bool = False) -> torch.Tensor:
    """float64 softmax(q Kᵀ / √D) V per request over its last `window` cached keys (the
    cache's values widened); with `q_rounded`, q scaled and rounded to int8 per head as an int8
    cache's integer scores take it."""
    q, k_cache, v_cache, table, lens = widened(case)
    scale = 1 / math.sqrt(q.shape[-1])
    if q_rounded:
        q, scale = dequantize_kv_rows(quantize_kv_rows(q * scale)), 1.0
    return plain_reference(q, k_cache, v_cache, table, lens, scale, window)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"),
                         [(3, 3, 64), (1, 4, 256), (2, 1, 32)])  # SmolLM2, Gemma 3, MHA
@pytest.mark.parametrize("window", [1, 31, 32, 33, 512])
def test_kernel_window_equals_float64(window: int, num_kv_heads: int, group: int,
                                      head_dim: int, cache_dtype: torch.dtype) -> None:
    case = with_cache_dtype(random_case(CONTEXTS, num_kv_heads=num_kv_heads, group=group,
                                        head_dim=head_dim, seed=window), cache_dtype)
    ours = decode_attention(*case, window=window)
    q_rounded = cache_dtype == torch.int8 and head_dim % 32 == 0
    assert relative_error(ours, windowed_reference(case, window, q_rounded)) < 1e-5
    if window >= max(CONTEXTS):  # a window past every context is the whole context
        assert torch.equal(ours, decode_attention(*case))


def test_window_changes_only_contexts_longer_than_it() -> None:
    case = random_case([5, 40, 600], num_kv_heads=1, group=4, head_dim=64)
    whole, windowed = decode_attention(*case), decode_attention(*case, window=40)
    assert torch.equal(windowed[:2], whole[:2])
    assert not torch.allclose(windowed[2], whole[2])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(("prompt_len", "chunk", "decodes", "window"),
                         [(700, range(700), (5, 600), 512), (1500, range(1000, 1300), (3,), 33),
                          (1100, range(1023, 1100), (), 100), (90, range(90), (), 7)])
def test_window_rows_together_equal_each_alone(prompt_len: int, chunk: range,
                                               decodes: tuple[int, ...], window: int,
                                               num_threads: int,
                                               cache_dtype: torch.dtype) -> None:
    """A prefill chunk's rows attended in blocks with a window keep each row's bits alone:
    a token's windowed result does not depend on the chunk it came in."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        q, k_cache, v_cache, tables, lens = with_cache_dtype(
            chunk_case(prompt_len, chunk, decodes), cache_dtype)
        together = decode_attention(q, k_cache, v_cache, tables, lens, window=window)
        alone = torch.cat([decode_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                            lens[i : i + 1], window=window)
                           for i in range(len(lens))])
        assert torch.equal(together, alone)
        reference = windowed_reference((q, k_cache, v_cache, tables, lens), window)
        assert relative_error(together, reference) < 1e-5
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("window", [3, 20])
def test_sdpa_backend_window_equals_the_kernel(window: int) -> None:
    """A step of two decodes and a prefill chunk over a cached prefix: the gather + SDPA
    backend's windowed rows equal the kernel backend's."""
    block_size, num_kv_heads, group, head_dim = 4, 2, 2, 16
    q_dec, k_cache, v_cache, table, _ = random_case([9, 30], num_kv_heads=num_kv_heads,
                                                       group=group, head_dim=head_dim,
                                                       block_size=block_size)
    chunk_len = 6  # positions 20..25 of a third request, over blocks no decode holds
    q = torch.cat([q_dec, torch.randn(chunk_len, num_kv_heads * group, head_dim)])
    k = torch.randn(2 + chunk_len, num_kv_heads, head_dim)
    v = torch.randn(2 + chunk_len, num_kv_heads, head_dim)
    k_cache = torch.cat([k_cache, torch.randn(num_kv_heads, 7, block_size, head_dim)], dim=1)
    v_cache = torch.cat([v_cache, torch.randn(num_kv_heads, 7, block_size, head_dim)], dim=1)
    fresh = np.arange(table.shape[1]) % 7 + k_cache.shape[1] - 7
    tables = np.concatenate([table.numpy(), fresh[None].astype(np.int32)])
    step = make_step_input([8, 29, 20], [1, 1, chunk_len], tables, block_size)
    outs = []
    for backend_type in (SdpaBackend, CpuPagedBackend):
        backend = backend_type(block_size=block_size, num_kv_heads=num_kv_heads,
                               num_blocks=k_cache.shape[1], device=torch.device("cpu"))
        meta = backend.build_metadata(step)
        outs.append(backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta,
                                    window=window))
    assert relative_error(outs[1], outs[0]) < 1e-5


def test_negative_window_is_refused() -> None:
    case = random_case([20], num_kv_heads=1, group=1, head_dim=8)
    with pytest.raises(RuntimeError, match="window must be 0"):
        decode_attention(*case, window=-1)


def write_tiny_mistral(path: Path, tokenizer: Any) -> Any:
    """A 2-layer Mistral with every layer in a window of 24 keys, random weights (seed 1234)
    and the default model's tokenizer, saved in `path`; its config."""
    import transformers
    from conftest import _spread_norm_weights

    config = transformers.MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        sliding_window=24, bos_token_id=1, eos_token_id=2, initializer_range=0.05)
    torch.manual_seed(1234)
    model = transformers.MistralForCausalLM(config)
    _spread_norm_weights(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return config


def test_mistral_window_runs_past_it_and_equals_transformers(
        tmp_path: Path, default_tokenizer: Any) -> None:
    """Mistral's every layer windowed: the context is no longer capped at the window, and
    greedy tokens for prompts far past it equal transformers' (alone and batched)."""
    from helpers import hf_model
    from test_equivalence import assert_tokens_match

    config = write_tiny_mistral(tmp_path, default_tokenizer)
    assert ArchConfig.from_hf_config(config.to_dict()).layer_window(1) == 24
    # the window's blocks are given back: 10 blocks (not 36) still make the batch preempt
    assert_tokens_match(str(tmp_path), hf_model(tmp_path), 49152, num_blocks=10)

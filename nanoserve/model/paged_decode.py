"""Decode attention that reads the paged KV cache in place, through `csrc/paged_attention.cpp`.

What it computes: for each decode request b and query head h, softmax(q[b, h] · Kᵀ / √D) · V
over the request's `context_lens[b]` cached tokens, whose rows are found through
`block_table[b]` (token t at row t % block_size of block `block_table[b, t // block_size]`).
That is what attention.py's `_decode_attention` (one gather of every request's blocks into a
padded buffer, a key mask, SDPA) computes; tests/model/test_paged_attention.py holds them equal
within 1e-5 relative. The kernel walks each (request, KV head) once, loading every key and value
row a single time for the H / Hkv query heads that share it (GQA), with an online softmax over
tiles of 128 keys and AVX2 dot products; float32 throughout.

FIGURES
"""

from __future__ import annotations

import functools
import math

import torch

from nanoserve.model.native import load_kernels


@functools.cache
def can_read_cache_in_place(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention on a cache of this device and dtype can use the kernel (CPU,
    float32, and the kernel built); the first call builds or loads it."""
    return (device.type == "cpu" and dtype == torch.float32
            and load_kernels("paged_attention") is not None)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [B, H, D], caches [Hkv, num_blocks, block_size, D], block_table [B, max_blocks] int32,
    context_lens [B] int32 -> [B, H * D]."""
    kernels = load_kernels("paged_attention")
    assert kernels is not None, "check can_read_cache_in_place before choosing this path"
    batch, num_heads, head_dim = q.shape
    out = q.new_empty(batch, num_heads, head_dim)
    kernels.decode_attention(q.contiguous(), k_cache, v_cache, block_table, context_lens,
                             1.0 / math.sqrt(head_dim), out)
    return out.view(batch, num_heads * head_dim)

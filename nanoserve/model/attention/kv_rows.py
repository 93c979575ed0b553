"""The paged KV cache's rows: their layout, the int8 row format, and writing a step's keys.

The KV cache of one layer is two tensors [num_kv_heads, num_blocks, block_size, head_dim]. A
token's keys and values live at flat index `block_id * block_size + offset` of every head's
plane (vLLM's "slot mapping"; here `cache_index`, since a "slot" is a request's row in the
sampler). Heads come first so that a gather of whole blocks gives each (head, request) its keys
as one contiguous [context, head_dim] matrix, the layout attention's small matmuls run fastest
on (measured: about a third less time per decode step's attention than token-major blocks).

The cache may hold float16 while the model computes in float32 (`--kv-cache-dtype`, chosen by
the engine): new keys and values are rounded as they are written, and whatever is read from
the cache is widened to the queries' dtype.

An int8 cache (`--kv-cache-dtype int8`) holds each key or value head as D int8 values and their
float32 scale, a row of D + 4 bytes (`quantize_kv_rows`; csrc/kv_int8.h does the same in C++).
Only the CPU kernel reads it (cpu_paged.py), so it is chosen only where that kernel runs.
"""

from __future__ import annotations

import numpy as np
import torch

KV_INT8_SCALE_BYTES = 4  # an int8 row's float32 scale, after its D values


def cache_row_elements(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension: head_dim, plus the scale's 4 bytes in an int8 cache."""
    return head_dim + KV_INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float32 -> [..., D + 4] int8: each row as round-half-even(x * 127 / amax), then
    amax / 127 as float32 in the last 4 bytes (what csrc/kv_int8.h computes, bit for bit)."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).to(torch.int8)
    scale = (amax / 127.0).contiguous().view(torch.int8)  # [..., 4]
    return torch.cat([q, scale], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] float32 (q * scale): what the kernel attends to."""
    scale = rows[..., -KV_INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return rows[..., :-KV_INT8_SCALE_BYTES].float() * scale


def head_block_rows(block_ids: np.ndarray, num_kv_heads: int, num_blocks: int) -> np.ndarray:
    """Every head's copy of `block_ids`, as rows of the cache viewed as [Hkv * num_blocks, ...]:
    gathering whole rows along the first dimension is a plain copy per block, faster than an
    `index_select` along the cache's block dimension."""
    heads = np.arange(num_kv_heads, dtype=np.int64)[:, None] * num_blocks
    return (heads + block_ids.reshape(1, -1)).reshape(-1)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, cache_index: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into the caches' rows `cache_index` [T], in the cache's dtype."""
    num_kv_heads = k.shape[1]
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows = (quantize_kv_rows(new.float()) if cache.dtype == torch.int8
                else new.to(cache.dtype))
        cache.view(num_kv_heads, -1, cache.shape[-1]).index_copy_(
            1, cache_index, rows.transpose(0, 1))

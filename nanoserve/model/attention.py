"""Attention over the paged KV cache for a flat batch that mixes decodes and prefill chunks.

The KV cache of one layer is two tensors [num_kv_heads, num_blocks, block_size, head_dim]. A
token's keys and values live at flat index `block_id * block_size + offset` of every head's
plane (vLLM's "slot mapping"; here `cache_index`, since a "slot" is a request's row in the
sampler). Heads come first so that a gather of whole blocks gives each (head, request) its keys
as one contiguous [context, head_dim] matrix, the layout attention's small matmuls run fastest
on (measured: about a third less time per decode step's attention than token-major blocks).

The cache may hold float16 while the model computes in float32 (`--kv-cache-dtype`, chosen by
the engine): new keys and values are rounded as they are written, and whatever is gathered from
the cache is widened to the queries' dtype before SDPA. A prefill chunk attending to itself uses
its keys and values rounded the same way, so a prompt's result does not depend on how it was
split into chunks or how much of it the prefix cache held.

An int8 cache (`--kv-cache-dtype int8`) holds each key or value head as D int8 values and their
float32 scale, a row of D + 4 bytes (`quantize_kv_rows`; csrc/kv_int8.h does the same in C++).
Only the CPU kernel reads it, so only where that kernel runs every query (model_runner.py).

Decodes (one query each) are attended all together. On the CPU, over a float32, float16 or
int8 cache, a C++ kernel reads their blocks where they lie (paged_decode.py: 2-10x faster than the
gather below, figures there); elsewhere, and as the reference it is tested against, their blocks
are gathered with one `index_select` into a padded [num_decodes, max_blocks * block_size] key
range and masked. Prefill chunks, few per step, are attended one by one; that loop is the only
per-sequence work in a step. Their gather of a cached prefix stays: measured at 1-11% of a
chunk's attention (chunks of 16 to 512 tokens over contexts of 256 to 2,048, one thread),
against SDPA's blocked matmuls that an in-place kernel would have to match.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve.model import paged_decode


@dataclass
class PrefillChunk:
    """One request's run of new tokens (two or more) in the flat batch."""

    start: int  # first row of the chunk in the flat batch
    num_tokens: int
    context_len: int  # tokens before the chunk plus the chunk itself
    # Blocks holding the whole context, when tokens before the chunk exist (chunked prefill or a
    # prefix-cache hit); None when the chunk is the whole context and attends to itself.
    # Indexes the cache's [num_kv_heads * num_blocks] block rows: see `head_block_rows`.
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [num_tokens, context_len] bool, causal with offset


@dataclass
class AttentionMetadata:
    """How this step's tokens map onto the KV cache; built once per step, read by every layer."""

    cache_index: torch.Tensor  # [num_tokens] int64, where each token's K/V is written
    num_decode_tokens: int  # the first rows of the batch are single-token requests
    # [num_kv_heads * num_decodes * max_blocks] int64 block rows (`head_block_rows`), padded
    decode_block_ids: torch.Tensor | None
    decode_key_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]
    # Set instead of the two above when decodes read the cache in place (paged_decode.py):
    decode_block_table: torch.Tensor | None = None  # [num_decodes, max_blocks] int32 block ids
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int32


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


def _gather_blocks(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[Hkv, num_blocks, block_size, D] cache -> [len(rows), block_size, D]."""
    return cache.view(-1, *cache.shape[2:]).index_select(0, rows)


def paged_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    stored: bool = False) -> torch.Tensor:
    """Write this step's keys/values into the cache, then attend. Returns [num_tokens, H * D].

    `stored`: the caller wrote them already (llama.py's fused path); k and v are then read only
    by prefill chunks that attend to themselves, and may be None in a step without prefills."""
    num_tokens, num_heads, head_dim = q.shape  # q: [T, H, D]; k, v: [T, Hkv, D]
    # 1) store the new keys and values in their cache slots
    if not stored:
        assert k is not None and v is not None, "paged_attention stores k and v unless stored"
        write_kv_cache(k, v, k_cache, v_cache, meta.cache_index)

    num_decodes = meta.num_decode_tokens
    if not meta.prefills:
        return _attend_decodes(q, k_cache, v_cache, meta)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    # 2) all decodes at once
    if num_decodes:
        out[:num_decodes] = _attend_decodes(q[:num_decodes], k_cache, v_cache, meta)
    # 3) each prefill chunk on its own
    assert k is not None and v is not None, "prefill chunks read this step's k and v"
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
    return out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, cache_index: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into the caches' rows `cache_index` [T], in the cache's dtype."""
    num_kv_heads = k.shape[1]
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows = (quantize_kv_rows(new.float()) if cache.dtype == torch.int8
                else new.to(cache.dtype))
        cache.view(num_kv_heads, -1, cache.shape[-1]).index_copy_(
            1, cache_index, rows.transpose(0, 1))


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q: [B, H, D] -> [B, H * D], by the in-place kernel when the runner chose it."""
    if meta.decode_block_table is not None and meta.decode_context_lens is not None:
        return paged_decode.decode_attention(q, k_cache, v_cache, meta.decode_block_table,
                                             meta.decode_context_lens)
    return _decode_attention(q, k_cache, v_cache, meta)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
    """One query per request against its gathered blocks. q: [B, H, D] -> [B, H * D]."""
    assert meta.decode_block_ids is not None and meta.decode_key_mask is not None
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    num_keys = meta.decode_key_mask.shape[-1]
    # [Hkv, B, max_blocks * block_size, D]: index_select on whole blocks is a plain block copy.
    # Attention is independent per (request, head), so the KV head serves as SDPA's batch
    # dimension and the request as its head dimension: no transpose of the keys.
    # A float16 cache's rows become q's dtype after the gather: SDPA takes one dtype.
    keys = _gather_blocks(k_cache, meta.decode_block_ids).view(
        num_kv_heads, batch, num_keys, head_dim).to(q.dtype)
    values = _gather_blocks(v_cache, meta.decode_block_ids).view(
        num_kv_heads, batch, num_keys, head_dim).to(q.dtype)
    # Grouped-query attention without copying keys: the H / Hkv query heads that share a KV
    # head act as that head's queries. [Hkv, B, H / Hkv, D]
    grouped_q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    out = F.scaled_dot_product_attention(grouped_q, keys, values,
                                         attn_mask=meta.decode_key_mask.transpose(0, 1))
    return out.transpose(0, 1).reshape(batch, num_heads * head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
    """Causal attention of one chunk. q: [n, H, D], k/v: [n, Hkv, D] -> [n, H * D]."""
    num_tokens, num_heads, head_dim = q.shape
    if chunk.block_ids is None:  # the chunk is the whole context
        if k_cache.dtype != k.dtype:
            # Attend to what the cache holds (rounded to its dtype), as a later chunk or a
            # prefix-cache hit reads it: the prompt's result then does not depend on how it
            # was split or whether part of it was cached (greedy text would, at near-ties).
            k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, n, D]
        mask, is_causal = None, True
    else:
        num_kv_heads = k_cache.shape[0]
        keys = _gather_blocks(k_cache, chunk.block_ids).view(num_kv_heads, -1, head_dim)
        values = _gather_blocks(v_cache, chunk.block_ids).view(num_kv_heads, -1, head_dim)
        # [Hkv, ctx, D] in q's dtype (the cache may hold float16)
        keys = keys[:, : chunk.context_len].to(q.dtype)
        values = values[:, : chunk.context_len].to(q.dtype)
        mask, is_causal = chunk.mask, False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
        keys.unsqueeze(0), values.unsqueeze(0),  # [1, Hkv, ctx, D]
        attn_mask=mask, is_causal=is_causal, enable_gqa=True,
    )  # [1, H, n, D]
    return out[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)

"""Attention over the paged KV cache for a flat batch that mixes decodes and prefill chunks.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A
token's keys and values live at flat index `block_id * block_size + offset` (vLLM's "slot
mapping"; here `cache_index`, since a "slot" is a request's row in the sampler).

Decodes (one query each) are attended all together: their blocks are gathered with one
`index_select` into a padded [num_decodes, max_blocks * block_size] key range and masked. Prefill
chunks, few per step, are attended one by one; that loop is the only per-sequence work in a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One request's run of new tokens (two or more) in the flat batch."""

    start: int  # first row of the chunk in the flat batch
    num_tokens: int
    context_len: int  # tokens before the chunk plus the chunk itself
    # Blocks holding the whole context, when tokens before the chunk exist (chunked prefill or a
    # prefix-cache hit); None when the chunk is the whole context and attends to itself.
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [num_tokens, context_len] bool, causal with offset


@dataclass
class AttentionMetadata:
    """How this step's tokens map onto the KV cache; built once per step, read by every layer."""

    cache_index: torch.Tensor  # [num_tokens] int64, where each token's K/V is written
    num_decode_tokens: int  # the first rows of the batch are single-token requests
    decode_block_ids: torch.Tensor | None  # [num_decodes * max_blocks] int64, padded with 0
    decode_key_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillChunk]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Write this step's keys/values into the cache, then attend. Returns [num_tokens, H * D]."""
    num_tokens, num_heads, head_dim = q.shape  # q: [T, H, D]; k, v: [T, Hkv, D]
    num_kv_heads = k.shape[1]
    # 1) store the new keys and values in their cache slots
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.cache_index, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.cache_index, v)

    num_decodes = meta.num_decode_tokens
    if not meta.prefills:
        return _decode_attention(q, k_cache, v_cache, meta)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    # 2) all decodes at once
    if num_decodes:
        out[:num_decodes] = _decode_attention(q[:num_decodes], k_cache, v_cache, meta)
    # 3) each prefill chunk on its own
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
    """One query per request against its gathered blocks. q: [B, H, D] -> [B, H * D]."""
    assert meta.decode_block_ids is not None and meta.decode_key_mask is not None
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_keys = meta.decode_key_mask.shape[-1]
    # [B, max_blocks * block_size, Hkv, D]: index_select on whole blocks is a plain block copy
    keys = k_cache.index_select(0, meta.decode_block_ids).view(batch, num_keys, num_kv_heads,
                                                               head_dim)
    values = v_cache.index_select(0, meta.decode_block_ids).view(batch, num_keys, num_kv_heads,
                                                                 head_dim)
    # Grouped-query attention without copying keys: the H / Hkv query heads that share a KV
    # head act as that head's queries. [B, Hkv, H / Hkv, D]
    grouped_q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped_q, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=meta.decode_key_mask)
    return out.reshape(batch, num_heads * head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
    """Causal attention of one chunk. q: [n, H, D], k/v: [n, Hkv, D] -> [n, H * D]."""
    num_tokens, num_heads, head_dim = q.shape
    if chunk.block_ids is None:
        keys, values, mask, is_causal = k, v, None, True
    else:
        num_kv_heads = k_cache.shape[2]
        keys = k_cache.index_select(0, chunk.block_ids).view(-1, num_kv_heads, head_dim)
        values = v_cache.index_select(0, chunk.block_ids).view(-1, num_kv_heads, head_dim)
        keys, values = keys[: chunk.context_len], values[: chunk.context_len]
        mask, is_causal = chunk.mask, False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
        keys.transpose(0, 1).unsqueeze(0),  # [1, Hkv, ctx, D]
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, is_causal=is_causal, enable_gqa=True,
    )  # [1, H, n, D]
    return out[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)

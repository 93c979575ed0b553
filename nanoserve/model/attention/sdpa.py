"""Attention by gathering cached blocks and running SDPA: the reference backend.

Decodes (one query each) are attended all together: their blocks are gathered with one
`index_select` into a padded [num_decodes, max_blocks * block_size] key range and masked. On
the CPU the kernel backend (cpu_paged.py) reads the cache in place instead, 2-10x faster (its
figures there), and is tested against this path. Prefill chunks, few per step, are attended
one by one; that loop is the only per-sequence work in a step. Their gather of a cached prefix
stays: measured at 1-11% of a chunk's attention (chunks of 16 to 512 tokens over contexts of
256 to 2,048, one thread), against SDPA's blocked matmuls that an in-place kernel would have
to match.

What is gathered from a float16 cache is widened to the queries' dtype before SDPA. A prefill
chunk attending to itself uses its keys and values rounded to the cache's dtype the same way,
so a prompt's result does not depend on how it was split into chunks or how much of it the
prefix cache held.

Attention sinks (gpt-oss: a logit per query head in the softmax's denominator, no value) ride
in SDPA as one more key: a zero key row scores exactly 0, the float mask adds the head's sink
logit on that column, and its zero value row adds nothing to the output (`_with_sink_key`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve.model.attention.base import AttentionBackend, AttentionMetadata
from nanoserve.model.attention.kv_rows import head_block_rows, write_kv_cache

if TYPE_CHECKING:
    from nanoserve.protocol import StepInput


@dataclass
class PrefillChunk:
    """One request's run of new tokens in the flat batch, attended causally."""

    start: int  # first row of the chunk in the flat batch
    num_tokens: int
    context_len: int  # tokens before the chunk plus the chunk itself
    # Blocks holding the whole context, when tokens before the chunk exist (chunked prefill or a
    # prefix-cache hit); None when the chunk is the whole context and attends to itself.
    # Indexes the cache's [num_kv_heads * num_blocks] block rows: see `head_block_rows`.
    block_ids: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [num_tokens, context_len] bool, causal with offset
    # [num_tokens] int64, each token's key end where an image's placeholders attend their
    # whole image (StepInput.key_ends); None: causal
    key_ends: torch.Tensor | None = None


@dataclass
class GatheredDecodes:
    """The step's decodes (one query each, the batch's first rows), as padded block rows."""

    # [num_kv_heads * num_decodes * max_blocks] int64 block rows (`head_block_rows`)
    block_rows: torch.Tensor
    key_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool
    context_lens: torch.Tensor  # [num_decodes] int64

    def window_mask(self, window: int) -> torch.Tensor:
        """key_mask, less the keys before each request's last `window` (0: key_mask)."""
        if not window:
            return self.key_mask
        keys = torch.arange(self.key_mask.shape[-1], device=self.key_mask.device)
        in_window = keys[None, :] >= (self.context_lens - window)[:, None]
        return self.key_mask & in_window[:, None, None, :]

    @property
    def num_decodes(self) -> int:
        return self.key_mask.shape[0]


@dataclass
class SdpaMetadata(AttentionMetadata):
    """The decodes' gathered blocks (None in a step without decodes) and each chunk's own."""

    decodes: GatheredDecodes | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def reads_new_kv(self) -> bool:
        return bool(self.prefills)  # chunks that attend to themselves read k and v


class SdpaBackend(AttentionBackend[SdpaMetadata]):
    """Gather + SDPA: decodes all at once, then each run of tokens (prefill chunk) causally."""

    def build_metadata(self, step: StepInput) -> SdpaMetadata:
        num_decodes, starts = step.num_decodes, step.query_start_loc
        decodes = (self._gathered_decodes(step.block_table[:num_decodes],
                                          step.context_lens[:num_decodes])
                   if num_decodes else None)
        prefills = [self._prefill_chunk(int(starts[i]), int(starts[i + 1] - starts[i]),
                                        int(step.context_lens[i]), step.block_table[i])
                    for i in range(num_decodes, step.num_requests)]
        if len(step.key_ends):  # images seen both ways: each chunk's own key ends
            for chunk in prefills:
                chunk.key_ends = self._tensor(
                    step.key_ends[chunk.start : chunk.start + chunk.num_tokens].astype(np.int64))
        return SdpaMetadata(self._tensor(step.cache_index), decodes, prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: SdpaMetadata,
                stored: bool = False, window: int = 0, *,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape  # q: [T, H, D]; k, v: [T, Hkv, D]
        # 1) store the new keys and values in their cache rows
        if not stored:
            assert k is not None and v is not None, "forward stores k and v unless stored"
            write_kv_cache(k, v, k_cache, v_cache, meta.cache_index)
        decodes = meta.decodes
        if not meta.prefills:
            assert decodes is not None, "a step computes at least one token"
            return gather_decode_attention(q, k_cache, v_cache, decodes, window, sinks=sinks)
        out = q.new_empty(num_tokens, num_heads * head_dim)
        # 2) all decodes at once
        if decodes is not None:
            num_decodes = decodes.num_decodes
            out[:num_decodes] = gather_decode_attention(q[:num_decodes], k_cache, v_cache,
                                                        decodes, window, sinks=sinks)
        # 3) each prefill chunk on its own
        assert k is not None and v is not None, "prefill chunks read this step's k and v"
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk,
                                          window, sinks=sinks)
        return out

    def _gathered_decodes(self, table: np.ndarray, context_lens: np.ndarray
                          ) -> GatheredDecodes:
        """Block rows and key mask for decodes with block table `table` [B, >= max_blocks]
        and context lengths [B]. Entries past a request's own blocks are stale: valid block
        ids, never read unmasked."""
        size = self.block_size
        max_blocks = int(-(-context_lens.max() // size))
        padded = np.ascontiguousarray(table[:, :max_blocks])  # [B, max_blocks]
        mask = np.arange(max_blocks * size)[None, :] < context_lens[:, None]
        rows = head_block_rows(padded.astype(np.int64), self.num_kv_heads, self.num_blocks)
        return GatheredDecodes(self._tensor(rows), self._tensor(mask[:, None, None, :]),
                               self._tensor(context_lens.astype(np.int64)))

    def _prefill_chunk(self, first_row: int, num_tokens: int, context_len: int,
                       blocks: np.ndarray) -> PrefillChunk:
        chunk = PrefillChunk(first_row, num_tokens, context_len)
        start = context_len - num_tokens
        if start > 0:  # earlier tokens are in the cache: read the whole context from there
            num_blocks = -(-context_len // self.block_size)
            chunk.block_ids = self._tensor(head_block_rows(
                blocks[:num_blocks], self.num_kv_heads, self.num_blocks))
            query_pos = np.arange(start, context_len)[:, None]
            chunk.mask = self._tensor(np.arange(context_len)[None, :] <= query_pos)
        return chunk


def _gather_blocks(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[Hkv, num_blocks, block_size, D] cache -> [len(rows), block_size, D]."""
    return cache.view(-1, *cache.shape[2:]).index_select(0, rows)


def _with_sink_key(keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                   sink_logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """keys and values [..., S, D] with a zero row appended, and the float mask [..., L, S + 1]
    that SDPA then takes: 0 where `allowed` (bool, broadcast to [..., L, S]), -inf elsewhere,
    and `sink_logits` (broadcast to [..., L, 1]) on the new key's column.

    Why a key, not SDPA then a correction by the log-sum-exp: SDPA does not return the
    log-sum-exp, and recomputing it takes a second pass over the scores. Here the zero key's
    score is exactly 0, so its masked score is exactly the sink logit, and its zero value
    weighs nothing: softmax([scores, sink]) · [V; 0], the eager reference's formula."""
    zero = keys.new_zeros(*keys.shape[:-2], 1, keys.shape[-1])
    bias = torch.zeros(allowed.shape, dtype=keys.dtype, device=keys.device)
    bias.masked_fill_(~allowed, float("-inf"))
    rows = torch.broadcast_shapes(bias.shape[:-1], sink_logits.shape[:-1])  # [..., L]
    mask = torch.cat([bias.expand(*rows, bias.shape[-1]),
                      sink_logits.to(keys.dtype).expand(*rows, 1)], dim=-1)
    return torch.cat([keys, zero], dim=-2), torch.cat([values, zero], dim=-2), mask


def gather_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            decodes: GatheredDecodes, window: int = 0, *,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per request against its gathered blocks (its last `window` of them where
    window > 0), head h's sink logit sinks[h] in its denominator where `sinks` [H] is given.
    q: [B, H, D] -> [B, H * D]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    num_keys = decodes.key_mask.shape[-1]
    # [Hkv, B, max_blocks * block_size, D]: index_select on whole blocks is a plain block copy.
    # Attention is independent per (request, head), so the KV head serves as SDPA's batch
    # dimension and the request as its head dimension: no transpose of the keys.
    # A float16 cache's rows become q's dtype after the gather: SDPA takes one dtype.
    keys = _gather_blocks(k_cache, decodes.block_rows).view(
        num_kv_heads, batch, num_keys, head_dim).to(q.dtype)
    values = _gather_blocks(v_cache, decodes.block_rows).view(
        num_kv_heads, batch, num_keys, head_dim).to(q.dtype)
    # Grouped-query attention without copying keys: the H / Hkv query heads that share a KV
    # head act as that head's queries. [Hkv, B, H / Hkv, D]
    grouped_q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    mask = decodes.window_mask(window).transpose(0, 1)  # [1, B, 1, max_blocks * block_size]
    if sinks is not None:  # head h = kv_head * G + g: [Hkv, 1, G, 1]
        keys, values, mask = _with_sink_key(keys, values, mask,
                                            sinks.view(num_kv_heads, 1, -1, 1))
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask)
    return out.transpose(0, 1).reshape(batch, num_heads * head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, chunk: PrefillChunk, window: int = 0, *,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one chunk (each token over its last `window` keys where window >
    0; head h's sink logit sinks[h] in its denominator where `sinks` [H] is given).
    q: [n, H, D], k/v: [n, Hkv, D] -> [n, H * D]."""
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
    if window or chunk.key_ends is not None:  # a mask of each token's keys
        query_pos = torch.arange(chunk.context_len - num_tokens, chunk.context_len,
                                 device=q.device)[:, None]
        key_pos = torch.arange(keys.shape[1], device=q.device)[None, :]
        # causal, or to its image's end; less the keys before its window (transformers'
        # "sliding and (causal or same image)")
        ends = query_pos + 1 if chunk.key_ends is None else chunk.key_ends[:, None]
        mask, is_causal = key_pos < ends, False
        if window:
            mask = mask & (key_pos > query_pos - window)
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)  # [1, Hkv, ctx, D]
    if sinks is not None:
        if mask is None:  # causal over the chunk itself, as a mask the sink's column can join
            mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).tril()
        keys, values, mask = _with_sink_key(keys, values, mask, sinks.view(1, -1, 1, 1))
        is_causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
        keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=True,
    )  # [1, H, n, D]
    return out[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)

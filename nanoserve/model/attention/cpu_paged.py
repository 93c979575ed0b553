"""The CPU backend: attention that reads the paged KV cache in place (`csrc/paged_attention.cpp`).

What it computes: for each query token and query head h, softmax(q[h] · Kᵀ / √D) · V over its
request's first `context_lens` cached tokens, found through its `block_table` row (token t at
row t % block_size of block `block_table[t // block_size]`), as sdpa.py's
`gather_decode_attention` does (tests/model/test_paged_attention.py: within 1e-5 relative).
Arithmetic is float32 over a float32, float16 or int8 cache (`--kv-cache-dtype`;
engine/model_runner.py says when "auto" picks float16); each key and value row is loaded once
for the query heads that share it (GQA). Attention sinks (`sinks` [H] float32, gpt-oss) join
each head's softmax denominator once, where the kernel normalizes a row (after its whole walk
or its partitions' merge), so the bit-for-bit contracts below hold with them too.

Every token of a step, a prefill chunk's too, is attended as a decode over the cache up to its
own position, after the step's keys and values are written: a token's result is then the same
bits whatever chunk it came in and whatever the prefix cache held, which SDPA over a chunk
cannot give (a chunk's rows are walked in blocks of 16, `csrc/run_attend.h`, each with the bits
it gets alone).

Why a kernel, not gather + SDPA: the gather copies every request's whole context into a padded
buffer, per layer, before SDPA reads it again; the kernel reads each row once, where it lies:
2.2-9.9x less time a step on 2 cores. Figures: docs/benchmarks.md, "Decode attention over the
paged cache".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.profiler import record_function

from nanoserve.model.attention.base import AttentionBackend, AttentionMetadata
from nanoserve.model.attention.kv_rows import write_kv_cache
from nanoserve.model.gemma4_native import build_gemma4_stack
from nanoserve.model.hybrid_native import build_hybrid_stack
from nanoserve.model.layer_weights import StackedModel
from nanoserve.model.native_layers import build_layer_stack
from nanoserve.native import load_kernels

if TYPE_CHECKING:
    from nanoserve.protocol import StepInput

# what the kernel reads (int8 rows carry their scale: kv_rows.py's quantize_kv_rows); q is
# always float32
CACHE_DTYPES = (torch.float32, torch.float16, torch.int8)


@functools.cache
def can_read_cache_in_place(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether attention on a cache of this device and dtype can use the kernel (CPU,
    float32, float16 or int8, and the kernel built); the first call builds or loads it."""
    return (device.type == "cpu" and dtype in CACHE_DTYPES
            and load_kernels("paged_attention") is not None)


@dataclass
class CpuPagedMetadata(AttentionMetadata):
    """One query per token of the step, each with its request's blocks and its own context."""

    block_table: torch.Tensor  # [T, max_blocks] int32 block ids, each token's request's row
    context_lens: torch.Tensor  # [T] int32, each token's position + 1 (its image's end)
    # [T] int32 position + 1, where an image's placeholders attend past it (the step's
    # key_ends): a window still ends at the token itself; None in a causal step
    window_ends: torch.Tensor | None = None


class CpuPagedBackend(AttentionBackend[CpuPagedMetadata]):
    """Every token attended as a decode by the kernel, over the cache where it lies."""

    def __init__(self, *, block_size: int, num_kv_heads: int, num_blocks: int,
                 device: torch.device) -> None:
        super().__init__(block_size=block_size, num_kv_heads=num_kv_heads,
                         num_blocks=num_blocks, device=device)
        kernels = load_kernels("paged_attention")
        assert kernels is not None, "check can_read_cache_in_place before choosing this backend"
        self._kernel = kernels.decode_attention

    def layer_stack(self, model: StackedModel,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any | None:
        """The native layer stack (native_layers.py; Gemma 4's, gemma4_native.py; a hybrid's,
        hybrid_native.py), which attends with this kernel."""
        if model.arch.gemma4 is not None:
            return build_gemma4_stack(model, kv_caches)
        if model.arch.linear is not None:
            return build_hybrid_stack(model, kv_caches)
        return build_layer_stack(model, kv_caches)

    def run_layer_stack(self, stack: Any, hidden: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, positions: torch.Tensor, meta: CpuPagedMetadata,
                        rope_local: tuple[torch.Tensor, torch.Tensor] | None = None,
                        group_metas: list[CpuPagedMetadata] | None = None,
                        per_layer_inputs: torch.Tensor | None = None) -> torch.Tensor:
        args = (hidden, cos, sin, positions, meta.cache_index, meta.block_table,
                meta.context_lens)
        if rope_local is None and not group_metas and per_layer_inputs is None:
            return stack.forward(*args)  # (the compiled stand-in takes these only)
        local_cos, local_sin = rope_local or (cos, sin)
        metas = group_metas or []
        ple = () if per_layer_inputs is None else (per_layer_inputs,)  # (Gemma 4's stack)
        return stack.forward(*args, local_cos, local_sin, [m.cache_index for m in metas],
                             [m.block_table for m in metas], *ple)

    def build_metadata(self, step: StepInput) -> CpuPagedMetadata:
        num_queries = np.diff(step.query_start_loc)  # [R], tokens per request
        table = (step.block_table if step.num_requests == step.num_decodes
                 else np.repeat(step.block_table, num_queries, axis=0))  # [T, max_blocks]
        both_ways = len(step.key_ends) > 0
        context_lens = step.key_ends if both_ways else step.positions + 1
        max_blocks = int(-(-context_lens.max() // self.block_size))
        return CpuPagedMetadata(self._tensor(step.cache_index),
                                self._tensor(np.ascontiguousarray(table[:, :max_blocks])),
                                self._tensor(context_lens.astype(np.int32)),
                                self._tensor((step.positions + 1).astype(np.int32))
                                if both_ways else None)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: CpuPagedMetadata,
                stored: bool = False, window: int = 0, *,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if not stored:
            assert k is not None and v is not None, "forward stores k and v unless stored"
            write_kv_cache(k, v, k_cache, v_cache, meta.cache_index)
        # decode_attention's call, made here: every layer calls this, and a frame fewer counts
        batch, num_heads, head_dim = q.shape
        q_f32 = q.to(torch.float32).contiguous()  # the kernel computes in float32 (q is tiny)
        out = q_f32.new_empty(batch, num_heads, head_dim)
        args: tuple[Any, ...] = (q_f32, k_cache, v_cache, meta.block_table, meta.context_lens,
                                 1.0 / math.sqrt(head_dim), out, window)
        ends = meta.window_ends if window else None  # (a step with images seen both ways)
        if ends is not None or sinks is not None:
            args = (*args, ends, None if sinks is None else _sink_logits(sinks))
        if torch.autograd._profiler_enabled():  # lets `bench step` see the kernel (~40 ns)
            with record_function("nanoserve::decode_attention"):
                self._kernel(*args)
        else:
            self._kernel(*args)
        return out.view(batch, num_heads * head_dim).to(q.dtype)


def _sink_logits(sinks: torch.Tensor) -> torch.Tensor:
    """sinks as the kernel takes them: contiguous float32 [H] on the CPU (a no-op when they
    are already)."""
    return sinks.to(torch.float32).contiguous()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, context_lens: torch.Tensor,
                     window: int = 0, *, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], caches [Hkv, num_blocks, block_size, D] (float32 or float16; int8 rows
    are D + 4 bytes), block_table [B, max_blocks] int32, context_lens [B] int32 -> [B, H * D]
    in q's dtype, each row over its last `window` keys where window > 0, with head h's sink
    logit sinks[h] in its softmax's denominator where `sinks` [H] is given: the kernel on its
    own (the backend's forward makes the same call)."""
    kernels = load_kernels("paged_attention")
    assert kernels is not None, "check can_read_cache_in_place before choosing this backend"
    batch, num_heads, head_dim = q.shape
    q_f32 = q.to(torch.float32).contiguous()  # the kernel computes in float32 (q is tiny)
    out = q_f32.new_empty(batch, num_heads, head_dim)
    args: tuple[Any, ...] = (q_f32, k_cache, v_cache, block_table, context_lens,
                             1.0 / math.sqrt(head_dim), out, window)
    if sinks is not None:
        args = (*args, None, _sink_logits(sinks))  # (no window_ends)
    if torch.autograd._profiler_enabled():  # lets `bench step` see the kernel (~40 ns)
        with record_function("nanoserve::decode_attention"):
            kernels.decode_attention(*args)
    else:
        kernels.decode_attention(*args)
    return out.view(batch, num_heads * head_dim).to(q.dtype)

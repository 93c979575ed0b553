"""The CPU backend: attention that reads the paged KV cache in place (`csrc/paged_attention.cpp`).

What it computes: for each decode request b and query head h, softmax(q[b, h] · Kᵀ / √D) · V
over the request's `context_lens[b]` cached tokens, whose rows are found through
`block_table[b]` (token t at row t % block_size of block `block_table[b, t // block_size]`).
That is what sdpa.py's `gather_decode_attention` (one gather of every request's blocks into a
padded buffer, a key mask, SDPA) computes; tests/model/test_paged_attention.py holds them equal
within 1e-5 relative. The kernel walks each (request, KV head) once, loading every key and value
row a single time for the H / Hkv query heads that share it (GQA), with an online softmax over
tiles of 32 keys and AVX2 dot products; float32 arithmetic throughout, over a float32 or a
float16 cache (below).

Why a kernel: the gather copies every decode's whole context, per layer, into a fresh padded
buffer (at batch 64 x 1,024 tokens, 100 MB a layer, page faults included) before SDPA reads it
again; the kernel reads each row once, from where it lies, at about the machine's memory
bandwidth (~21 GB/s here). Measured on a 2-core AVX2 machine, torch.set_num_threads(2), default
model shapes (30 layers, 9 heads, 3 KV heads, D = 64, blocks of 16, each layer's own cache,
blocks shuffled), best of interleaved runs:

    batch  context | per layer: gather+SDPA  kernel | per step (30 layers): gather+SDPA  kernel
        1      256 |              0.064 ms  0.016 ms |                        1.9 ms   0.5 ms  3.9x
        1    1,024 |              0.209 ms  0.068 ms |                        6.3 ms   2.0 ms  3.1x
       16      256 |              0.664 ms  0.296 ms |                       19.9 ms   8.9 ms  2.2x
       16    1,024 |              3.18 ms   1.16 ms  |                       95 ms    35 ms    2.7x
       64      256 |              3.47 ms   1.33 ms  |                      104 ms    40 ms    2.6x
       64    1,024 |             45.0 ms    4.56 ms  |                     1350 ms   137 ms    9.9x

With one thread the ratios are 2.2-8.7x. The runner's per-step tables shrink too (the padded
per-head block rows and key mask are no longer built: 10-70 us down to 4-35 us). The kernel's
own choices (tile size, prefetching, splitting a context over threads) are measured in its
source.

A float16 cache (`--kv-cache-dtype`; engine/model_runner.py says when "auto" picks it) holds
each row in half the bytes. The kernel loads 8 halves at a time and widens them with F16C's
`vcvtph2ps`; q, the scores, the softmax and the sums stay float32, so it computes what the
gather path computes on the rounded values (the tests hold them within 1e-5). Per step (30
layers, shapes as above), float32 vs float16 cache through the same build, medians of
interleaved runs: on the 2-core machine, shared with other jobs (one thread: with two, other
jobs' load swamped the figures), and on a quiet 16-core Xeon pinned to 2 cores, 2 threads:

                   |  2-core machine, 1 thread   |  Xeon, 2 cores, 2 threads
    batch  context |  float32  float16           |  float32  float16
        1      256 |   1.09 ms  0.61 ms  1.8x    |   0.57 ms  0.50 ms  1.1x
        1    1,024 |   3.97 ms  2.05 ms  1.9x    |   1.95 ms  2.03 ms  1.0x
       16      256 |  31.9 ms  16.7 ms   1.9x    |  12.0 ms   8.3 ms   1.4x
       16    1,024 | 130 ms    64.2 ms   2.0x    |  41.6 ms  27.4 ms   1.5x
       64      256 | 148 ms    77.7 ms   1.9x    |  41.2 ms  27.0 ms   1.5x
       64    1,024 | 583 ms   311 ms     1.9x    | 175 ms   116 ms     1.5x

Where the cache comes from DRAM the time follows the bytes. At batch 1 x 1,024 the Xeon gained
nothing: its 30 layers' cache (47 MB in float32) likely sits in that machine's large L3, where
the kernel is bound by arithmetic and the widening is not free. The float32 path runs the same
instructions as before the kernel was templated (timed beside the old build: within noise).

Every token of a step is attended this way, prefill chunks' tokens too: each is a query over
the cache up to its own position (`context_lens` = position + 1), after the whole step's keys
and values are written. A token's result is then the same whatever chunk it came in and
whatever the prefix cache held, bit for bit (as a decode's is, alone or batched), which SDPA
over a chunk cannot give. At prompts of 32-512 tokens it is as fast as SDPA or faster
(0.5-1.05x its time, one and two threads, measured). A chunk's rows share their keys, so the
kernel walks them in blocks of 16 rows (`csrc/run_attend.h`): each tile's rows are widened once
for the block, and each row gets the bits it gets alone. The last 512-token chunk of a
6,656-token prompt (one layer, float16 cache, 2 threads): 486-540 -> 305-342 ms, interleaved.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.profiler import record_function

from nanoserve.model.attention.base import AttentionBackend, AttentionMetadata
from nanoserve.model.attention.kv_rows import write_kv_cache
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
    context_lens: torch.Tensor  # [T] int32, each token's position + 1


class CpuPagedBackend(AttentionBackend[CpuPagedMetadata]):
    """Every token attended as a decode by the kernel, over the cache where it lies."""

    def __init__(self, *, block_size: int, num_kv_heads: int, num_blocks: int,
                 device: torch.device) -> None:
        super().__init__(block_size=block_size, num_kv_heads=num_kv_heads,
                         num_blocks=num_blocks, device=device)
        kernels = load_kernels("paged_attention")
        assert kernels is not None, "check can_read_cache_in_place before choosing this backend"
        self._kernel = kernels.decode_attention

    def build_metadata(self, step: StepInput) -> CpuPagedMetadata:
        num_queries = np.diff(step.query_start_loc)  # [R], tokens per request
        table = (step.block_table if step.num_requests == step.num_decodes
                 else np.repeat(step.block_table, num_queries, axis=0))  # [T, max_blocks]
        context_lens = step.positions + 1
        max_blocks = int(-(-context_lens.max() // self.block_size))
        return CpuPagedMetadata(self._tensor(step.cache_index),
                                self._tensor(np.ascontiguousarray(table[:, :max_blocks])),
                                self._tensor(context_lens.astype(np.int32)))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: CpuPagedMetadata,
                stored: bool = False) -> torch.Tensor:
        if not stored:
            assert k is not None and v is not None, "forward stores k and v unless stored"
            write_kv_cache(k, v, k_cache, v_cache, meta.cache_index)
        # decode_attention's call, made here: every layer calls this, and a frame fewer counts
        batch, num_heads, head_dim = q.shape
        q_f32 = q.to(torch.float32).contiguous()  # the kernel computes in float32 (q is tiny)
        out = q_f32.new_empty(batch, num_heads, head_dim)
        args = (q_f32, k_cache, v_cache, meta.block_table, meta.context_lens,
                1.0 / math.sqrt(head_dim), out)
        if torch.autograd._profiler_enabled():  # lets `bench step` see the kernel (~40 ns)
            with record_function("nanoserve::decode_attention"):
                self._kernel(*args)
        else:
            self._kernel(*args)
        return out.view(batch, num_heads * head_dim).to(q.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [B, H, D], caches [Hkv, num_blocks, block_size, D] (float32 or float16; int8 rows
    are D + 4 bytes), block_table [B, max_blocks] int32, context_lens [B] int32 -> [B, H * D]
    in q's dtype: the kernel on its own (the backend's forward makes the same call)."""
    kernels = load_kernels("paged_attention")
    assert kernels is not None, "check can_read_cache_in_place before choosing this backend"
    batch, num_heads, head_dim = q.shape
    q_f32 = q.to(torch.float32).contiguous()  # the kernel computes in float32 (q is tiny)
    out = q_f32.new_empty(batch, num_heads, head_dim)
    args = (q_f32, k_cache, v_cache, block_table, context_lens, 1.0 / math.sqrt(head_dim), out)
    if torch.autograd._profiler_enabled():  # lets `bench step` see the kernel (~40 ns)
        with record_function("nanoserve::decode_attention"):
            kernels.decode_attention(*args)
    else:
        kernels.decode_attention(*args)
    return out.view(batch, num_heads * head_dim).to(q.dtype)

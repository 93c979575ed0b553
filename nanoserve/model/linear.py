"""Matmuls against fixed weights. On the CPU they run through oneDNN with pre-packed weights.

MKL's sgemm (what F.linear uses on the CPU) is slow for the small row counts of decoding: on a
2-core AVX2 machine the default model's layers take ~45 ms per token at 1 row and ~90 ms at 4
rows. oneDNN with weights reordered once, at load, into its blocked layout takes ~25-30 ms at
both, and ~30% less at 64 rows (inductor's CPU "freezing" path uses the same two ops). Results
differ from F.linear only in summation order (~1e-6 relative). Figures: docs/benchmarks.md,
"Before: float32 weights".
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.profiler import record_function

# The row count oneDNN tunes the packed layout for; measured: any value from 64 to 512 serves
# 1 to 512 rows within a few percent, while a hint of 1 is ~40% slower at 64 rows.
PACKING_BATCH_HINT = 64

# oneDNN keeps a compiled primitive per (rows, in, out) it has run, and PyTorch's ideep layer a
# computation per shape, up to 1,024 each by default. A server's row counts are every batch and
# chunk size, so at 1,024 the two caches grew the engine's resident memory for hours; at 64
# they stop growing at no loss of speed (docs/benchmarks.md, "oneDNN's primitive caches").
ONEDNN_CACHE_CAPACITY = 64


def bound_onednn_caches() -> None:
    """Caps both caches, unless the user set them. Each is sized from the environment the first
    time oneDNN creates a primitive, which packing a weight does before any matmul."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))  # ideep's


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's blocked layout where that pays, else unchanged."""
    if not can_pack(weight):
        return weight
    bound_onednn_caches()
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)


class MatmulWeight(Protocol):
    """A weight held in another form (quantization.py): it multiplies by itself."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


def linear(x: torch.Tensor, weight: torch.Tensor | MatmulWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, for plain, packed or quantized weights. x: [rows, in] -> [rows, out]."""
    if not isinstance(weight, torch.Tensor):
        if torch.autograd._profiler_enabled():  # lets `bench step` see the kernel (~40 ns)
            with record_function("nanoserve::quant_matmul"):
                out = weight.matmul(x)
        else:
            out = weight.matmul(x)
        return out if bias is None else out + bias
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)

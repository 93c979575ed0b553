"""The decoder layer's element-wise work as a few C++ calls (`csrc/fused_ops.cpp`).

What each computes, against the plain PyTorch ops it replaces (layer_ops.py's EXACT_OPS):

  rms_norm(x, w, eps)             F.rms_norm(x, (N,), w, eps)                       [T, N]
  add_rms_norm(h, delta, w, eps)  h += delta (in place), then F.rms_norm(h, ...)     [T, N]
  silu_mul(gate_up)               gate, up = gate_up.chunk(2, -1); F.silu(gate) * up [T, I]
  gelu_tanh_mul(gate_up)          the same with F.gelu(gate, approximate="tanh")     [T, I]
  rope_store(qkv, bias, q_norm, k_norm, eps, cos_table, sin_table, positions,
             k_cache, v_cache, cache_index) -> q [T, H, D]
      qkv + bias (Qwen2); F.rms_norm of each q and k head (Qwen3); apply_rope on q and k with
      rows `positions` of RotaryEmbedding's own cos/sin tables (so Llama 3 and linear scaling
      come with the table); k and v written into the paged caches (float32, float16 rounded
      to nearest even, or int8 rows as attention/kv_rows.py's `quantize_kv_rows` makes them)
      at `cache_index`, as `write_kv_cache` there does.
      qkv's k and v columns are left holding the rotated k and biased v (prefill chunks that
      attend to themselves read them there).
  gated_rms_norm(x, z, w, eps)    F.rms_norm(x per head of w's D, (D,), w, eps) * F.silu(z)
                                  (a Gated DeltaNet's output norm)                  [T, H * D]
  sigmoid_mul(x, gate)            x * torch.sigmoid(gate) (Qwen3.5's attention gate) [T, N]

The last two (csrc/gated_rows.h) are hybrid_layers.cpp's too: its stack and the Python layers
then give the same bits, whatever vector code PyTorch's own ops would pick on this CPU.

tests/model/test_fused_ops.py (and test_gated_rows.py the last two) holds each to the plain
ops: norms and gates within 1e-5 relative (another summation order, another exp polynomial),
RoPE within 1e-6, v exactly and k in a float16 cache within one float16 step (a k that differs
in its last float32 bit may round the other way). All take float32 activations and run on one
thread below ~32K elements (a decode of a few dozen rows), on both above.

Why: the plain layer runs ~25 PyTorch ops between its four matmuls, each a few microseconds of
dispatch, allocation and Python for a few hundred floats at batch 1, and at batch 64 its own
pass over memory; fused, a layer's element-wise work at batch 1 takes 4.8 us instead of 127 us
(docs/benchmarks.md, "The layer's element-wise work in C++").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch.profiler import record_function

from nanoserve.model.linear import linear
from nanoserve.model.quant_linear import QuantizedWeight
from nanoserve.native import load_kernels

Matmul = Callable[[torch.Tensor], torch.Tensor]


def kernels() -> ModuleType | None:
    """The compiled `fused_ops` extension, or None where it cannot be built."""
    return load_kernels("fused_ops")


@dataclass(frozen=True)
class FusedOps:
    """The kernel's calls, plain or each inside a profiler scope (`bench step` sees them
    only that way; choosing once per step keeps the check off every call)."""

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    gelu_tanh_mul: Callable[..., torch.Tensor]
    rope_store: Callable[..., torch.Tensor]
    gated_rms_norm: Callable[..., torch.Tensor]
    sigmoid_mul: Callable[..., torch.Tensor]
    is_profiled: bool


@functools.cache
def fused_ops(profiled: bool = False) -> FusedOps:
    native = kernels()
    assert native is not None, "check kernels() before choosing the fused path"
    names = ("rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul", "rope_store",
             "gated_rms_norm", "sigmoid_mul")
    calls = {name: getattr(native, name) for name in names}
    if profiled:
        calls = {name: _scoped(f"nanoserve::{name}", call) for name, call in calls.items()}
    return FusedOps(**calls, is_profiled=profiled)


def bind_matmul(weight: Any, profiled: bool = False) -> Matmul:
    """x -> x @ weight.T for a weight held in any form (plain, packed or quantized); a packed
    quantized weight calls its kernel directly (no dispatch or shape checks in Python: the
    fused path's activations are always contiguous float32 [rows, in])."""
    call: Matmul
    if weight is None:  # a MoE layer's dense projections: it has none (moe.py runs its experts)
        return _absent_weight
    if isinstance(weight, QuantizedWeight) and weight.is_packed:
        native = load_kernels("quant_matmul")
        assert native is not None, "a packed QuantizedWeight exists only where the kernel loads"
        packed_matmul = native.packed_matmul
        data, ggml_type, num_rows, in_features, wide = weight.packed_args()

        # a closure with positional arguments, not a functools.partial of the kernel (whose
        # keyword arguments pybind11 parses: 1.5-1.8 us more a call at one row, measured)
        def call(x: torch.Tensor) -> torch.Tensor:
            return packed_matmul(x, data, ggml_type, num_rows, in_features, wide)
    elif isinstance(weight, torch.Tensor):
        call = functools.partial(linear, weight=weight)
    else:
        call = weight.matmul
    if profiled and not isinstance(weight, torch.Tensor):  # a tensor's oneDNN op is seen anyway
        return _scoped("nanoserve::quant_matmul", call)
    return call


def _absent_weight(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this layer has no such projection (a MoE layer has no dense MLP)")


def _scoped(name: str, call: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def scoped(*args: Any) -> torch.Tensor:
        with record_function(name):
            return call(*args)
    return scoped

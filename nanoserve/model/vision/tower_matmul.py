"""How a vision tower holds its matmul weights (q/k/v, out, fc1, fc2, the projector, Qwen's
patch embedding and merger) and in which dtype it attends, from the text model's resolved
quantization mode.

  float32  mode "none", or any device but the CPU: the weights as loaded, F.linear and float32
           attention; equal to transformers (the parity tests hold 1e-4).
  bf16     a quantized mode on a CPU with AMX-BF16: weights rounded to bfloat16, each matmul's
           input rounded to bfloat16 and its float32 output kept (oneDNN's AMX kernels), and
           attention in bfloat16; the residual stream, norms and biases stay float32.
  int8     a quantized mode on any other CPU: weights quantized to Q8_0 at load and multiplied
           by the int8 kernels of quant_linear.py (activations rounded to int8 blocks of 32);
           a weight whose inputs are not a multiple of 32 (SigLIP's fc2, 4304) stays float32.

Why bf16 beats the int8 kernels where AMX-BF16 exists: a tower's matmuls have thousands of rows
(4,096 patches for an 896 or 1024 px image), where oneDNN's AMX-BF16 runs ~700-1,000 GFLOP/s
on a 2-core AMX Xeon against ~190-230 for the int8 kernels and ~125-150 for float32, and
bfloat16 attention is 2.9x float32's. Whole towers: 2.3x (SigLIP) and 2.9x (Qwen3.5's ViT)
faster than float32 in bf16, 1.1x and 1.3x with the int8 kernels; bf16 is also the closer of
the two (cosine to float32 0.99996 against 0.9998-0.9999). AVX-512-BF16 without AMX was not
measured, so such a CPU takes the int8 kernels. Figures: docs/benchmarks.md, "Vision towers
on the int8 kernels".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.model.linear import MatmulWeight
from nanoserve.model.quant_linear import QuantizedWeight
from nanoserve.native import cpu_flags

TOWER_FORMS = ("float32", "bf16", "int8")


def tower_form(quantization: str, device: torch.device) -> str:
    """The form a tower's matmuls take for the text model's resolved mode on `device`."""
    if quantization == "none" or device.type != "cpu":
        return "float32"
    # only AMX-BF16 was measured faster than the int8 kernels (the module docstring)
    return "bf16" if "amx_bf16" in (cpu_flags() or frozenset()) else "int8"


def attention_dtype(form: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tower of `form` (weights in `dtype`) runs attention in."""
    return torch.bfloat16 if form == "bf16" else dtype


class Bf16Weight:
    """A weight [N, K] rounded to bfloat16: x [..., K] (any float dtype) is rounded to bfloat16
    for the product, which comes back in x's dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.shape = tuple(self.weight.shape)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)


def tower_matmul(weight: torch.Tensor, form: str) -> torch.Tensor | MatmulWeight:
    """The object `linear()` multiplies by, for a tower's float weight [N, K] in `form`."""
    if form not in TOWER_FORMS:
        raise ValueError(f"tower form {form!r} is not one of {TOWER_FORMS}")
    if form == "bf16":
        return Bf16Weight(weight)
    if form == "int8" and weight.shape[1] % 32 == 0:
        return QuantizedWeight.from_float(weight)
    return weight

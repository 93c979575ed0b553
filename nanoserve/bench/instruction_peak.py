"""The matmul kernel's instruction peak beside a step's matmuls (`bench step`).

Two ceilings, measured at the start of the run on every thread (csrc/instruction_peak.h):

  kernel peak     the many-row kernel of each packed type the model holds, on a weight and
                  activations that stay in L1: its own instructions with nothing waiting on
                  memory. The step's is the multiply-add-weighted mean over its matmuls (a Q8_0
                  head's mix is slower than a Q4_1 layer's).
  multiply pipes  independent `maddubs` chains in registers: what any int8 kernel of this
                  instruction set could do.

A step's matmul rate is its multiply-adds over the profile's matmul time; against the kernel
peak, what it loses to memory, threads and the work around the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoserve.bench.floor import matmul_weights, weight_shape
from nanoserve.model.llama import CausalLM
from nanoserve.model.quant_linear import QuantizedWeight, kernels
from nanoserve.model.quantization import ConcatWeight

_ROWS = 16  # activation rows of the kernel peak: the many-row kernel, all in L1
_SECONDS = 0.3  # per measurement (three rounds, the best)


@dataclass(frozen=True)
class InstructionPeak:
    kernel_macs_per_s: float  # the step's mix of the many-row kernel, data in L1
    multiply_macs_per_s: float  # maddubs chains in registers
    by_type: dict[str, float]  # each packed type's kernel peak, by its GGUF name


def _quantized_parts(weight: Any) -> list[QuantizedWeight]:
    if isinstance(weight, QuantizedWeight):
        return [weight] if weight.is_packed else []
    if isinstance(weight, ConcatWeight):
        return [p for part in weight.parts for p in _quantized_parts(part)]
    return []


def measure_peak(model: CausalLM) -> InstructionPeak | None:
    """The two ceilings for this model's packed matmuls (None: no packed weights)."""
    native = kernels()
    parts = [p for w in matmul_weights(model) for p in _quantized_parts(w)]
    if native is None or not parts:
        return None
    from gguf import GGMLQuantizationType

    macs: dict[int, float] = {}
    for part in parts:
        rows, cols = weight_shape(part)
        macs[part.ggml_type] = macs.get(part.ggml_type, 0.0) + rows * cols
    rates = {t: native.kernel_peak(t, _ROWS, _SECONDS) for t in macs}
    # the step's mix: its multiply-adds over the time each type's share takes at its peak
    mixed = sum(macs.values()) / sum(m / rates[t] for t, m in macs.items())
    return InstructionPeak(mixed, native.multiply_peak(_SECONDS),
                           {GGMLQuantizationType(t).name: r for t, r in rates.items()})


def format_peak(peak: InstructionPeak, steps: list[tuple[int, float, float]]) -> str:
    """The ceilings, and (batch, matmul seconds, multiply-adds) rows against them."""
    types = ", ".join(f"{name} {rate / 1e9:.0f}" for name, rate in peak.by_type.items())
    kernel = peak.kernel_macs_per_s / 1e9
    lines = [f"instruction peak: the many-row kernel on data in L1 {kernel:.0f} GMAC/s for "
             f"this step's mix ({types}); maddubs chains in registers (the "
             f"multiply pipes) {peak.multiply_macs_per_s / 1e9:.0f} GMAC/s; all threads",
             "| batch | matmuls | multiply-adds | matmul rate | of the kernel peak | "
             "of the multiply pipes |",
             "|---:|---:|---:|---:|---:|---:|"]
    for batch, seconds, macs in steps:
        rate = macs / seconds if seconds else 0.0
        lines.append(f"| {batch} | {seconds * 1e3:.1f} ms | {macs / 1e9:.2f} G | "
                     f"{rate / 1e9:.0f} GMAC/s | {rate / peak.kernel_macs_per_s:.0%} | "
                     f"{rate / peak.multiply_macs_per_s:.0%} |")
    return "\n".join(lines)

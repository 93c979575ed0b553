"""How a model's matmul weights are held: `--quantization {auto, gguf, int8, fp16, none}`.

  gguf  a GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4), multiplied
        by the int8 kernel of quant_linear.py: activations rounded to 8 bits per block of 32,
        as llama.cpp does.
        Tensors of other types in the file are dequantized to float. The default for GGUF.
  int8  every matmul weight quantized at load to Q8_0 (int8 per block of 32 with an f16 scale),
        then the same kernel: for safetensors models (or to requantize a GGUF file).
  fp16  weights rounded to float16 and multiplied by fbgemm's fp16 kernel in float32 (~5e-4
        relative error; no activation rounding).
  none  float32 weights (oneDNN-packed, linear.py): the exact path, equal to transformers. The
        default for safetensors models and on CUDA.

Each mode gives the model one object per matmul weight with `matmul(x)`; `linear()` in
linear.py calls it. Norms, biases and RoPE tables stay float in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.model.linear import pack_weight
from nanoserve.model.quant_linear import BLOCK_FORMATS, QuantizedWeight, dequantize_raw

QUANTIZED_MODES = ("gguf", "int8", "fp16")


def resolve_mode(mode: str, is_gguf: bool, device: torch.device) -> str:
    """The mode to load with: "auto" resolved, and combinations that cannot run refused."""
    if mode == "auto":
        return "gguf" if is_gguf and device.type == "cpu" else "none"
    if mode in QUANTIZED_MODES and device.type != "cpu":
        raise ValueError(f"quantization={mode!r} runs on the CPU only; on {device.type} use "
                         "quantization='none'")
    if mode == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' needs a .gguf model file; for a safetensors "
                         "model use 'int8', 'fp16' or 'none'")
    return mode


@dataclass(frozen=True, eq=False)
class RawBlocks:
    """A GGUF tensor's rows as stored: uint8 [N, bytes per row], not yet dequantized."""

    data: np.ndarray | torch.Tensor
    ggml_type: int
    shape: tuple[int, int]  # (N, K) as PyTorch orders it

    @property
    def has_kernel(self) -> bool:
        return self.ggml_type in BLOCK_FORMATS

    def rows(self) -> torch.Tensor:
        """The raw bytes as a uint8 tensor [N, bytes per row] (a copy of the mapped file)."""
        data = self.data if isinstance(self.data, torch.Tensor) else torch.from_numpy(
            np.array(self.data, dtype=np.uint8))
        return data.reshape(self.shape[0], -1)

    def dequantize(self) -> torch.Tensor:
        return dequantize_raw(self.rows(), self.ggml_type, self.shape)


class Fp16Weight:
    """A weight rounded to float16 in fbgemm's packed layout; x stays float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = tuple(weight.shape)
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


class ConcatWeight:
    """Row blocks of one fused weight held in different formats (a GGUF file may store q, k
    and v in different types): each part's product, side by side."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.matmul(x) for part in self.parts], dim=-1)


MatmulWeight = torch.Tensor | QuantizedWeight | Fp16Weight | ConcatWeight


def fuse_rows(parts: list[torch.Tensor | RawBlocks]) -> torch.Tensor | RawBlocks | list[RawBlocks]:
    """Stack weights along their rows (q/k/v, gate/up). Raw blocks stay raw: neighbours of one
    type are joined, so a file with q/k in one type and v in another gives two runs (a
    ConcatWeight later). Anything else is dequantized and stacked as float."""
    if not all(isinstance(p, RawBlocks) and p.has_kernel for p in parts):
        return torch.cat([as_float(p) for p in parts])
    runs: list[list[RawBlocks]] = []
    for part in parts:
        assert isinstance(part, RawBlocks)
        if runs and runs[-1][0].ggml_type == part.ggml_type:
            runs[-1].append(part)
        else:
            runs.append([part])
    joined = [RawBlocks(torch.cat([b.rows() for b in run]), run[0].ggml_type,
                        (sum(b.shape[0] for b in run), run[0].shape[1])) for run in runs]
    return joined[0] if len(joined) == 1 else joined


def as_float(value: torch.Tensor | RawBlocks | list[RawBlocks]) -> torch.Tensor:
    if isinstance(value, list):
        return torch.cat([part.dequantize() for part in value])
    return value.dequantize() if isinstance(value, RawBlocks) else value


def shape_of(value: torch.Tensor | RawBlocks | list[RawBlocks]) -> tuple[int, ...]:
    if isinstance(value, list):
        return (sum(part.shape[0] for part in value), value[0].shape[1])
    return tuple(value.shape)


def make_matmul_weight(value: torch.Tensor | RawBlocks | list[RawBlocks], mode: str,
                       dtype: torch.dtype, device: torch.device) -> MatmulWeight:
    """The object the model multiplies with, for a loaded weight [N, K] and a resolved mode."""
    if mode == "gguf" and isinstance(value, RawBlocks) and value.has_kernel:
        return QuantizedWeight.from_gguf(value.rows(), value.ggml_type, value.shape)
    if mode == "gguf" and isinstance(value, list):
        return ConcatWeight([QuantizedWeight.from_gguf(p.rows(), p.ggml_type, p.shape)
                             for p in value])
    weight = as_float(value)
    if mode == "int8" and weight.shape[1] % 32 == 0:
        return QuantizedWeight.from_float(weight)
    if mode == "fp16":
        return Fp16Weight(weight)
    return pack_weight(weight.to(device=device, dtype=dtype).contiguous())

"""Weights kept in their GGUF block formats, multiplied without dequantizing them first.

`QuantizedWeight.matmul(x)` computes x @ W.T for a weight W [N, K] stored as Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K or MXFP4 blocks (MXFP4 keeps its 4-bit codes and the kernel looks their int8
values up: gpt-oss's experts; safetensors MXFP4 converts with `mxfp4.py`). The C++ kernel
(`csrc/quant_matmul.cpp`, llama.cpp's scheme in our own code) repacks the blocks once, at load, into
tiles of 8 output rows; each call quantizes every row of x into int8 blocks of 32 with one float
scale (and the block's scaled sum, for the formats with an offset), multiplies them with AVX2
integer dot products and applies the two scales once per block. So the result is exactly W @ x8,
where x8 is x rounded to 8 bits per block: it differs from dequantize-then-matmul by ~5e-3 of the
output's norm. `rows(ids)` dequantizes single rows exactly (the token embedding, tied with lm_head).
Without a C++ compiler the weight is dequantized once, at first use, and runs through the float32
path.

Why not dequantize to float32 at load (`linear.py`'s oneDNN path): at one row the kernel reads
96 MB a step instead of 540 MB (3.3 ms against 25 ms for the default model's matmuls), and at
many rows its integer dot products still beat float FMAs (~85 GMAC/s a thread for Q4_1 against
~50), so prefill needs no dequantized copy either. The wide form of a 4-bit weight (`widened`,
a byte per value: no unpacking, the same products) is used from 16 rows on, where it is 3-6%
faster; below that the kernel waits on memory, and twice the bytes would cost more. The 5-bit
types (nibbles plus 5th bits, which cost more to unpack) have one too: 1.17-1.45x at 64 rows.
The loader keeps it when all of a model's wide forms fit in 1 GiB (weights.py). Figures:
docs/benchmarks.md, "Quantized matmuls against float32", "Latest: wide 4-bit weights" and
"The 5-bit types in the kernel".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from types import ModuleType

import numpy as np
import torch

from nanoserve.model.dequant import dequantize_fast
from nanoserve.model.linear import linear, pack_weight
from nanoserve.model.mxfp4 import GGML_MXFP4
from nanoserve.native import load_kernels

GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0 = 2, 3, 6, 7, 8
GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 12, 13, 14
# The 5-bit formats (packed as nibbles plus a plane of 5th bits: csrc/gguf_blocks.h).
FIVE_BIT_TYPES = frozenset({GGML_Q5_0, GGML_Q5_1, GGML_Q5_K})
# The 4- and 5-bit formats, which have a wide form (a byte instead of a nibble per value).
WIDE_TYPES = frozenset({GGML_Q4_0, GGML_Q4_1, GGML_Q4_K}) | FIVE_BIT_TYPES
# ggml type -> (inputs per block, bytes per block)
BLOCK_FORMATS: dict[int, tuple[int, int]] = {
    GGML_Q8_0: (32, 34), GGML_Q4_0: (32, 18), GGML_Q4_1: (32, 20),
    GGML_Q5_0: (32, 22), GGML_Q5_1: (32, 24),
    GGML_Q4_K: (256, 144), GGML_Q5_K: (256, 176), GGML_Q6_K: (256, 210),
    GGML_MXFP4: (32, 17),  # rows of 17-byte blocks: no alignment
}


def kernels() -> ModuleType | None:
    """The compiled `quant_matmul` extension, or None where it cannot be built."""
    return load_kernels("quant_matmul")


def row_bytes(ggml_type: int, in_features: int) -> int:
    """Bytes of one weight row of `in_features` inputs in the block format `ggml_type`."""
    if ggml_type not in BLOCK_FORMATS:
        raise ValueError(f"ggml type {ggml_type} has no quantized kernel; supported: "
                         f"{sorted(BLOCK_FORMATS)} (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, "
                         "Q6_K, MXFP4)")
    block, size = BLOCK_FORMATS[ggml_type]
    if in_features % block:
        raise ValueError(f"in_features={in_features} is not a multiple of {block}, the block "
                         f"size of ggml type {ggml_type}")
    return in_features // block * size


def dequantize_raw(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, int]
                   ) -> torch.Tensor:
    """The reference dequantization of raw GGUF rows: float32 [N, K]."""
    raw_np = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    fast = dequantize_fast(raw_np, ggml_type, shape)
    if fast is not None:
        return fast
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw_np.reshape(shape[0], -1), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A float weight [N, K] as raw Q8_0 rows (uint8 [N, K / 32 * 34]), our int8 format.

    Per block of 32: d = max|w| / 127 (stored f16), q = round-half-away(w / d). The same bytes
    as `gguf.quants.quantize` (ggml's reference), computed with torch ops instead of numpy.
    """
    num_rows, in_features = weight.shape
    row_bytes(GGML_Q8_0, in_features)  # checks the block size
    blocks = weight.detach().to(torch.float32).reshape(-1, 32)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    scaled = blocks * inverse
    magnitude = scaled.abs()
    whole = magnitude.floor()
    rounded = torch.sign(scaled) * (whole + torch.floor(2 * (magnitude - whole)))
    packed = torch.cat((scale.half().view(torch.uint8), rounded.to(torch.int8).view(torch.uint8)),
                       dim=1)  # [blocks, 34]
    return packed.reshape(num_rows, -1)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight [N, K] kept in a GGUF block format.

    `data` holds the kernel's packed layout when `is_packed`, else the file's raw rows (the
    fallback where no kernel could be built, or when asked for with `use_kernel=False`).
    """

    data: torch.Tensor  # uint8
    ggml_type: int
    shape: tuple[int, int]  # (N out features, K in features)
    is_packed: bool
    # A 4- or 5-bit packed weight's wide form (csrc/quant_matmul.cpp: a byte per value), used from
    # 16 activation rows on; None unless the loader kept one (see `widened`).
    wide: torch.Tensor | None = None

    @classmethod
    def from_gguf(cls, raw: np.ndarray | torch.Tensor, ggml_type: int, shape: tuple[int, int],
                  *, use_kernel: bool = True) -> QuantizedWeight:
        """From raw GGUF rows (uint8, N rows of `row_bytes` each), repacked for the kernel."""
        num_rows, in_features = shape
        expected = num_rows * row_bytes(ggml_type, in_features)
        if isinstance(raw, torch.Tensor):
            data = raw.detach().to(torch.uint8).contiguous().reshape(-1)
        else:  # a copy: GGUF arrays are read-only views of the mapped file
            data = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1))
        if data.numel() != expected:
            raise ValueError(f"a {ggml_type=} weight of shape {shape} needs {expected} bytes, "
                             f"got {data.numel()}")
        native = kernels() if use_kernel else None
        if native is None:
            return cls(data, ggml_type, (num_rows, in_features), is_packed=False)
        packed = native.repack(data, ggml_type, num_rows, in_features)
        return cls(packed, ggml_type, (num_rows, in_features), is_packed=True)

    @classmethod
    def from_float(cls, weight: torch.Tensor, *, use_kernel: bool = True) -> QuantizedWeight:
        """A float weight [N, K] quantized to Q8_0 (the int8 mode for safetensors models)."""
        raw = quantize_q8_0(weight)
        return cls.from_gguf(raw, GGML_Q8_0, (weight.shape[0], weight.shape[1]),
                             use_kernel=use_kernel)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T: x [..., K] -> float32 [..., N], x rounded to int8 blocks when packed."""
        num_rows, in_features = self.shape
        if self.is_packed and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            # the decode hot path: ~2 us of call overhead instead of ~6 us with the reshapes
            return self._native.packed_matmul(x, self.data, self.ggml_type, num_rows,
                                              in_features, self.wide)
        flat = x.reshape(-1, in_features).to(torch.float32).contiguous()  # [M, K]
        if self.is_packed:
            out = self._native.packed_matmul(flat, self.data, self.ggml_type, num_rows,
                                             in_features, self.wide)
        else:
            out = linear(flat, self._dense)
        return out.reshape(*x.shape[:-1], num_rows)

    def packed_args(self) -> tuple[torch.Tensor, int, int, int, torch.Tensor | None]:
        """What the kernel's packed_matmul takes after x: (packed, ggml_type, N, K, wide)."""
        assert self.is_packed, "only a packed weight multiplies through packed_matmul"
        num_rows, in_features = self.shape
        return self.data, self.ggml_type, num_rows, in_features, self.wide

    @property
    def can_widen(self) -> bool:
        return self.is_packed and self.ggml_type in WIDE_TYPES

    @property
    def wide_extra_bytes(self) -> int:
        """The memory a wide form adds to this (4- or 5-bit, packed) weight."""
        num_rows, in_features = self.shape
        padded_values = -(-num_rows // 8) * 8 * in_features  # the kernel packs rows 8 at a time
        if self.ggml_type in FIVE_BIT_TYPES:
            return padded_values * 3 // 8  # a byte for a nibble and a bit per value
        return padded_values // 2  # a byte for a nibble per value

    def widened(self) -> QuantizedWeight:
        """The same weight with its wide form kept beside the packed one: ~0.5 (5-bit: 0.375)
        more bytes per weight, for the same products sooner from 16 rows on (figures at the
        top)."""
        if not self.can_widen or self.wide is not None:
            return self
        wide = self._native.widen(self.data, self.ggml_type, *self.shape)
        return replace(self, wide=wide)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, dequantized exactly: ids [...] -> float32 [..., K] (an embedding)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if self.is_packed:
            out = self._native.packed_rows(self.data, self.ggml_type, flat, *self.shape)
        else:
            out = self.dequantize()[flat]
        return out.reshape(*ids.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K], equal to gguf's dequantization of the raw blocks."""
        if self.is_packed:
            return self._native.packed_rows(self.data, self.ggml_type,
                                            torch.arange(self.shape[0]), *self.shape)
        return dequantize_raw(self.data, self.ggml_type, self.shape)

    @cached_property
    def _native(self) -> ModuleType:
        native = kernels()
        assert native is not None, "a packed QuantizedWeight exists only where the kernel loads"
        return native

    @cached_property
    def _dense(self) -> torch.Tensor:
        # the fallback: dequantized once, then the float32 (oneDNN-packed) matmul
        return pack_weight(self.dequantize())

"""Fast dequantization of the common GGUF formats with torch ops (the rest go through `gguf`).

Block layouts (ggml's legacy quants, 32 weights per block, little-endian):
  Q8_0: f16 scale d, 32 x int8 q            -> w = d * q
  Q4_0: f16 scale d, 16 bytes of nibbles    -> w = d * (q - 8)
  Q4_1: f16 scale d, f16 min m, 16 bytes    -> w = d * q + m
  MXFP4: uint8 E8M0 e, 16 bytes of codes    -> w = 2^(e - 128) * MXFP4_VALUES[code]
In a nibble byte, the low 4 bits are weight j and the high 4 bits weight j + 16.
"""

from __future__ import annotations

import numpy as np
import torch

F32, F16, Q4_0, Q4_1, Q8_0, BF16, MXFP4 = 0, 1, 2, 3, 8, 30, 39
BLOCK = 32
# MXFP4's 16 codes: twice the E2M1 values (ggml's kvalues_mxfp4)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 128) for uint8 E8M0 bytes, exactly as ggml builds it (e = 0, 1: subnormals)."""
    e32 = e.to(torch.int32)
    bits = torch.where(e32 < 2, torch.bitwise_left_shift(torch.full_like(e32, 0x00200000), e32),
                       torch.bitwise_left_shift(e32 - 1, 23))
    return bits.view(torch.float32)


def dequantize_fast(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor | None:
    """float32 tensor of `shape` from raw bytes, or None when the format is not one of ours."""
    data = torch.from_numpy(raw.view(np.uint8).copy())
    if ggml_type == F32:
        values = data.view(torch.float32)
    elif ggml_type == F16:
        values = data.view(torch.float16).float()
    elif ggml_type == BF16:
        values = data.view(torch.bfloat16).float()
    elif ggml_type == Q8_0:
        blocks = data.view(-1, 34)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()  # [n, 1]
        values = blocks[:, 2:].contiguous().view(torch.int8).float() * scale
    elif ggml_type in (Q4_0, Q4_1):
        blocks = data.view(-1, 18 if ggml_type == Q4_0 else 20)
        scale = blocks[:, :2].contiguous().view(torch.float16).float()
        packed = blocks[:, -16:]
        nibbles = torch.cat((packed & 0x0F, packed >> 4), dim=1)  # [n, 32]
        if ggml_type == Q4_0:
            values = (nibbles.float() - 8.0) * scale
        else:
            minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
            values = nibbles.float() * scale + minimum
    elif ggml_type == MXFP4:
        blocks = data.view(-1, 17)
        packed = blocks[:, 1:]
        codes = torch.cat((packed & 0x0F, packed >> 4), dim=1).long()  # [n, 32]
        lookup = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
        values = lookup[codes] * e8m0_half(blocks[:, :1])
    else:
        return None
    return values.reshape(shape)

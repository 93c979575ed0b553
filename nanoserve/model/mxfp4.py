"""MXFP4 weights as transformers' safetensors store them, turned into GGUF's MXFP4 blocks.

gpt-oss checkpoints hold each expert matrix as `*_blocks` (uint8 [..., n / 32, 16]: byte j of a
block holds element 2j in its low nibble and 2j + 1 in its high nibble) and `*_scales` (uint8
[..., n / 32]): value = FP4_VALUES[code] * 2^(scale - 127), FP4_VALUES the E2M1 numbers
(transformers `integrations/mxfp4.py`). A GGUF MXFP4 block (ggml type 39) is 17 bytes, the scale
byte e then 16 bytes whose byte j holds element j low and j + 16 high: value =
kvalues[code] * 2^(e - 128) with kvalues = 2 * FP4_VALUES, so the code and the scale byte carry
over unchanged and only the nibbles move. Converted so, a safetensors checkpoint's experts run
through the same packed kernel (`QuantizedWeight.from_gguf(..., GGML_MXFP4, ...)`) as a GGUF
file's.
"""

from __future__ import annotations

import torch

GGML_MXFP4 = 39  # the ggml type of the blocks this module returns
MXFP4_BLOCK_BYTES = 17  # per 32 inputs: the E8M0 scale byte, then 16 bytes of codes


def hf_mxfp4_to_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GGUF MXFP4 rows with exactly the values of transformers' MXFP4 `blocks` and `scales`.

    blocks: uint8 [..., n / 32, 16] (element 2j low, 2j + 1 high in byte j); scales: uint8
    [..., n / 32] (E8M0). Returns uint8 [..., n / 32 * 17]: per block the scale byte, then byte
    j = element j | element j + 16 << 4. The leading dims (experts, output rows) stay, so each
    row is one weight row of n inputs in GGUF's layout.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., n / 32, 16] and scales [..., n / 32] disagree: "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    # codes in input order: [..., n / 32, 32]
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # [..., n / 32, 16] in GGUF's order
    out = torch.cat((scales.unsqueeze(-1), qs), dim=-1)  # [..., n / 32, 17]
    return out.flatten(-2)

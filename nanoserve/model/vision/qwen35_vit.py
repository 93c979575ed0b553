"""Qwen3.5's (and Qwen3.6's) vision tower in plain torch, equal to transformers'
`Qwen3_5Model.get_image_features(pixel_values, image_grid_thw).pooler_output` (concatenated).

Patches (rows of `Qwen35ImageProcessor.normalize`, merge-window-major) -> the Conv3D patch
embedding, which with stride = kernel is one matmul over each row -> plus the learned position
table (a square grid) resampled bilinearly, corners aligned, to each image's patch grid -> ViT
blocks (LayerNorm, attention with a 2-D rotary embedding of each patch's row and column and no
attention across images or frames, LayerNorm, MLP with GELU-tanh) -> the merger: LayerNorm,
each 2 x 2 window of patches concatenated (consecutive rows, by the patch order), fc1, exact
GELU, fc2 into the text model's width. Weights come from `qwen35_weights.py`, placed on their
device and dtype there; the matmul weights are whatever `linear()` multiplies by (float32
tensors, or bfloat16 / Q8_0 weights in a quantized mode: `tower_matmul.py`).

Speed: a Qwen3.5-2B-size tower on a 1024 x 1024 image (4,096 patches, 24 blocks) spends ~45%
of its float32 time in the matmuls and ~40% in attention (2-core AMX Xeon). Every matmul here
(the patch embedding too) has a multiple of 32 inputs, so the int8 kernels run them all and
save ~22%; bfloat16 on AMX (matmuls and attention) takes 2.9x less time at a cosine of
0.99997 to float32, so a quantized mode runs the tower that way where the CPU has AMX-BF16
(`tower_matmul.py`; figures: docs/benchmarks.md, "Vision towers on the int8 kernels").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.linear import MatmulWeight, linear


@dataclass(frozen=True)
class Qwen35VisionArch:
    """The tower's shape, from a Qwen3.5 config.json or an mmproj GGUF's metadata."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    merge_size: int
    num_position_embeddings: int  # a square grid of learned positions (2304 = 48^2 real)
    out_hidden_size: int  # the merger's output: the text model's hidden size
    layer_norm_eps: float
    rope_theta: float
    temporal_patch_size: int = 2
    in_channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """One patch row's width: channels x frames x patch x patch (1536 real)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def position_grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def merged_hidden_size(self) -> int:
        """The merger's input: merge x merge patches' features side by side."""
        return self.hidden_size * self.merge_size ** 2


@dataclass(frozen=True)
class VisionBlockWeights:
    """One ViT block."""

    norm1_weight: torch.Tensor
    norm1_bias: torch.Tensor
    qkv_weight: torch.Tensor | MatmulWeight  # [3 * hidden, hidden]
    qkv_bias: torch.Tensor
    out_weight: torch.Tensor | MatmulWeight  # [hidden, hidden]
    out_bias: torch.Tensor
    norm2_weight: torch.Tensor
    norm2_bias: torch.Tensor
    fc1_weight: torch.Tensor | MatmulWeight  # [intermediate, hidden]
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor | MatmulWeight  # [hidden, intermediate]
    fc2_bias: torch.Tensor


@dataclass(frozen=True)
class Qwen35TowerWeights:
    """Every tensor of the tower, already on the device and in the dtype it runs in."""

    patch_weight: torch.Tensor | MatmulWeight  # [hidden, patch_dim]: the Conv3D kernel, flattened
    patch_bias: torch.Tensor
    position_embedding: torch.Tensor  # [num_position_embeddings, hidden]
    blocks: tuple[VisionBlockWeights, ...]
    merger_norm_weight: torch.Tensor  # [hidden]
    merger_norm_bias: torch.Tensor
    merger_fc1_weight: torch.Tensor | MatmulWeight  # [merged_hidden, merged_hidden]
    merger_fc1_bias: torch.Tensor
    merger_fc2_weight: torch.Tensor | MatmulWeight  # [out_hidden, merged_hidden]
    merger_fc2_bias: torch.Tensor


class Qwen35VisionTower(nn.Module):
    """Images to Qwen3.5's image tokens: pixel_values float32 [P, patch_dim] (the images'
    `normalize`d rows, concatenated) and each image's grid (t, h, w) in patches, with
    P = sum(t * h * w) -> [sum(t * h * w / merge^2), out_hidden] in the weights' dtype, the
    images' tokens in order. Each frame of each image attends only to itself, in
    `attention_dtype`."""

    def __init__(self, arch: Qwen35VisionArch, weights: Qwen35TowerWeights,
                 attention_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.weights = weights
        self.attention_dtype = attention_dtype or weights.patch_bias.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.patch_bias.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.patch_bias.device

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """The image tokens one image of this grid becomes."""
        t, h, w = grid_thw
        return t * h * w // self.arch.merge_size ** 2

    def forward(self, pixel_values: torch.Tensor,
                grid_thw: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        arch, w = self.arch, self.weights
        grids = [tuple(int(n) for n in grid) for grid in grid_thw]
        num_patches = sum(t * h * w_ for t, h, w_ in grids)
        if pixel_values.shape != (num_patches, arch.patch_dim):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)} do not match "
                             f"the grids {grids}: expected ({num_patches}, {arch.patch_dim})")
        pixels = pixel_values.to(device=self.device, dtype=self.dtype)
        x = linear(pixels, w.patch_weight, w.patch_bias)  # [P, hidden]
        x = x + torch.cat([self._positions(h, w_).repeat(t, 1) for t, h, w_ in grids])
        cos, sin = self._rotary(grids)  # [P, head_dim] float32
        # attention segments: one per frame of each image (transformers' cu_seqlens)
        segments = [h * w_ for t, h, w_ in grids for _ in range(t)]
        for block in w.blocks:
            x = self._block(x, block, cos, sin, segments)
        x = F.layer_norm(x, (arch.hidden_size,), w.merger_norm_weight, w.merger_norm_bias,
                         arch.layer_norm_eps)
        x = x.reshape(-1, arch.merged_hidden_size)  # a merge window's patches are consecutive
        x = F.gelu(linear(x, w.merger_fc1_weight, w.merger_fc1_bias))
        return linear(x, w.merger_fc2_weight, w.merger_fc2_bias)

    def _positions(self, h: int, w: int) -> torch.Tensor:
        """[h * w, hidden]: the learned grid resampled to h x w patches (bilinear, corners
        aligned, in float32 as transformers' interpolation weights), merge-window-major."""
        arch, side, merge = self.arch, self.arch.position_grid_side, self.arch.merge_size
        table = self.weights.position_embedding.float().view(side, side, arch.hidden_size)
        grid = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode="bilinear",
                             align_corners=True)[0]  # [hidden, h, w]
        grid = grid.view(arch.hidden_size, h // merge, merge, w // merge, merge)
        return grid.permute(1, 3, 2, 4, 0).reshape(h * w, arch.hidden_size).to(self.dtype)

    def _rotary(self, grids: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, head_dim] float32: a quarter of the head's frequencies turn with the
        patch's row, a quarter with its column, laid out (row, column, row, column) for
        rotate-half, as transformers' Qwen3_5VisionRotaryEmbedding."""
        arch, merge, device = self.arch, self.arch.merge_size, self.device
        rows, cols = [], []
        for t, h, w in grids:
            row = torch.arange(h, device=device).view(h // merge, merge, 1, 1)
            col = torch.arange(w, device=device).view(1, 1, w // merge, merge)
            shape = (h // merge, merge, w // merge, merge)
            # merge-window-major: (h/m, w/m, m, m), as the patches
            rows.append(row.expand(shape).permute(0, 2, 1, 3).flatten().repeat(t))
            cols.append(col.expand(shape).permute(0, 2, 1, 3).flatten().repeat(t))
        half = arch.head_dim // 2
        inv_freq = 1.0 / (arch.rope_theta ** (
            torch.arange(0, half, 2, dtype=torch.float, device=device) / half))
        freqs_h = torch.cat(rows)[:, None].float() * inv_freq  # [P, head_dim / 4]
        freqs_w = torch.cat(cols)[:, None].float() * inv_freq
        angles = torch.cat([freqs_h, freqs_w, freqs_h, freqs_w], dim=-1)
        return angles.cos(), angles.sin()

    def _block(self, x: torch.Tensor, block: VisionBlockWeights, cos: torch.Tensor,
               sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        arch = self.arch
        num_patches, hidden = x.shape
        h = F.layer_norm(x, (hidden,), block.norm1_weight, block.norm1_bias, arch.layer_norm_eps)
        qkv = linear(h, block.qkv_weight, block.qkv_bias).to(self.attention_dtype)
        q, k, v = qkv.view(num_patches, 3, arch.num_heads, arch.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # [P, heads, head_dim]
        outputs = [
            F.scaled_dot_product_attention(  # scale 1/sqrt(head_dim), no mask inside a frame
                qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]
            )[0].transpose(0, 1)
            for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments),
                                  strict=True)]
        attended = torch.cat(outputs).reshape(num_patches, hidden).to(x.dtype)
        x = x + linear(attended, block.out_weight, block.out_bias)
        h = F.layer_norm(x, (hidden,), block.norm2_weight, block.norm2_bias, arch.layer_norm_eps)
        h = F.gelu(linear(h, block.fc1_weight, block.fc1_bias), approximate="tanh")
        return x + linear(h, block.fc2_weight, block.fc2_bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [P, heads, head_dim] by cos, sin [P, head_dim], in float32 and
    cast back (transformers' apply_rotary_pos_emb_vision)."""
    as_float = x.float()
    first, second = as_float.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (as_float * cos[:, None] + rotated * sin[:, None]).to(x.dtype)

"""Gemma 3's vision tower: SigLIP's vision encoder (no pooling head) and Gemma 3's
multimodal projector, in plain torch, equal to transformers'
`Gemma3Model.get_image_features(pixel_values).pooler_output`.

SigLIP: a patch-embedding convolution (stride = kernel = patch), a learned position embedding,
pre-norm encoder layers (LayerNorm, multi-head attention with biases, LayerNorm, MLP with
GELU-tanh), a final LayerNorm. Projector: average-pool the patch grid down to
sqrt(tokens_per_image)^2 cells, Gemma's RMSNorm (x * (1 + w), in float32), then
x @ W [vision_hidden, text_hidden] (held transposed, as every matmul weight here). Weights
come from `vision_weights.py`, placed on their device and dtype there; the matmul weights are
whatever `linear()` multiplies by (float32 tensors, or bfloat16 / Q8_0 weights in a quantized
mode: `tower_matmul.py`).

Speed: a SigLIP-So400m image (4,096 patches, 27 layers) spends ~45% of its float32 time in
the matmuls and ~40% in attention (2-core AMX Xeon). The int8 kernels save only ~11% of the
whole (attention and SigLIP's fc2, whose 4304 inputs are no Q8_0 multiple, stay float32);
bfloat16 on AMX (matmuls and attention) takes 2.3x less time at a cosine of 0.99996 to
float32, so a quantized mode runs the tower that way where the CPU has AMX-BF16
(`tower_matmul.py`; figures: docs/benchmarks.md, "Vision towers on the int8 kernels").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.linear import MatmulWeight, linear


@dataclass(frozen=True)
class SiglipArch:
    """The tower's shape, from a Gemma 3 config.json or an mmproj GGUF's metadata."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    layer_norm_eps: float
    text_hidden_size: int  # the projector's output width
    tokens_per_image: int
    # the projector's RMSNorm eps: transformers builds it with vision_config.layer_norm_eps
    # (Gemma3MultiModalProjector), llama.cpp with clip.vision.attention.layer_norm_epsilon
    soft_emb_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool_kernel(self) -> int:
        """The side of the patch square that is averaged into one soft token."""
        return self.patches_per_side // math.isqrt(self.tokens_per_image)


@dataclass(frozen=True)
class EncoderLayerWeights:
    """One SigLIP encoder layer; q, k and v fused into one [3 * hidden, hidden] matmul."""

    norm1_weight: torch.Tensor
    norm1_bias: torch.Tensor
    qkv_weight: torch.Tensor | MatmulWeight  # [3 * hidden, hidden]
    qkv_bias: torch.Tensor
    out_weight: torch.Tensor | MatmulWeight
    out_bias: torch.Tensor
    norm2_weight: torch.Tensor
    norm2_bias: torch.Tensor
    fc1_weight: torch.Tensor | MatmulWeight  # [intermediate, hidden]
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor | MatmulWeight  # [hidden, intermediate]
    fc2_bias: torch.Tensor


@dataclass(frozen=True)
class TowerWeights:
    """Every tensor of the tower, already on the device and in the dtype it runs in (the
    projector's norm scale stays float32, as transformers computes that norm)."""

    patch_weight: torch.Tensor  # [hidden, 3, patch, patch]
    patch_bias: torch.Tensor
    position_embedding: torch.Tensor  # [patches_per_side^2, hidden]
    layers: tuple[EncoderLayerWeights, ...]
    post_norm_weight: torch.Tensor
    post_norm_bias: torch.Tensor
    soft_emb_norm_scale: torch.Tensor  # 1 + w of Gemma's RMSNorm, float32 [hidden]
    input_projection: torch.Tensor | MatmulWeight  # [text_hidden, hidden]


class Gemma3VisionTower(nn.Module):
    """Images to Gemma 3's soft tokens: [N, 3, S, S] float32 pixels (`normalize`d) ->
    [N, tokens_per_image, text_hidden] in the weights' dtype. Each image is attended to on
    its own (the batch dimension is independent); attention runs in `attention_dtype`."""

    def __init__(self, arch: SiglipArch, weights: TowerWeights,
                 attention_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.weights = weights
        self.attention_dtype = attention_dtype or weights.patch_weight.dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.patch_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.patch_weight.device

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        arch, w = self.arch, self.weights
        pixels = pixel_values.to(device=self.device, dtype=self.dtype)
        x = F.conv2d(pixels, w.patch_weight, w.patch_bias, stride=arch.patch_size)
        x = x.flatten(2).transpose(1, 2) + w.position_embedding  # [N, patches, hidden]
        for layer in w.layers:
            x = self._encoder_layer(x, layer)
        x = F.layer_norm(x, (arch.hidden_size,), w.post_norm_weight, w.post_norm_bias,
                         arch.layer_norm_eps)
        return self._project(x)

    def _encoder_layer(self, x: torch.Tensor, layer: EncoderLayerWeights) -> torch.Tensor:
        arch = self.arch
        num_images, num_patches, hidden = x.shape
        h = F.layer_norm(x, (hidden,), layer.norm1_weight, layer.norm1_bias, arch.layer_norm_eps)
        qkv = linear(h, layer.qkv_weight, layer.qkv_bias).to(self.attention_dtype)
        # [3, N, heads, patches, head_dim]
        qkv = qkv.view(num_images, num_patches, 3, arch.num_heads, arch.head_dim).permute(
            2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # scale 1/sqrt(d)
        attended = attended.transpose(1, 2).reshape(num_images, num_patches, hidden)
        x = x + linear(attended.to(x.dtype), layer.out_weight, layer.out_bias)
        h = F.layer_norm(x, (hidden,), layer.norm2_weight, layer.norm2_bias, arch.layer_norm_eps)
        h = F.gelu(linear(h, layer.fc1_weight, layer.fc1_bias), approximate="tanh")
        return x + linear(h, layer.fc2_weight, layer.fc2_bias)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """[N, patches, hidden] -> [N, tokens_per_image, text_hidden]."""
        arch, w = self.arch, self.weights
        num_images, _, hidden = x.shape
        side = arch.patches_per_side
        grid = x.transpose(1, 2).reshape(num_images, hidden, side, side)
        pooled = F.avg_pool2d(grid, arch.pool_kernel, stride=arch.pool_kernel)
        pooled = pooled.flatten(2).transpose(1, 2)  # [N, tokens, hidden]
        # Gemma's RMSNorm runs in float32 and casts back (Gemma3RMSNorm)
        as_float = pooled.float()
        normed = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True)
                                        + arch.soft_emb_norm_eps)
        normed = (normed * w.soft_emb_norm_scale).to(pooled.dtype)
        return linear(normed, w.input_projection)

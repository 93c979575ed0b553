"""Rotary position embeddings, computed once as a cos/sin table and looked up per step."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from nanoserve.model.arch import ArchConfig, RopeScaling, yarn_mscale


def inverse_frequencies(arch: ArchConfig, rope_factors: torch.Tensor | None = None) -> torch.Tensor:
    """The per-pair rotation speeds, computed exactly as transformers does (float32 throughout).

    `rope_factors` is llama.cpp's way of storing Llama 3.1 scaling in a GGUF file (the
    `rope_freqs.weight` tensor): each frequency is divided by its factor. With partial rotary
    (Qwen3.5) the pairs past the rotary dims get frequency 0 (model/hybrid_weights.py puts
    the head's dims in the order that makes this partial RoPE).
    """
    if arch.rotary_dim < arch.head_dim:  # partial rotary: the dims RoPE leaves stay still
        inv_freq = inverse_frequencies(replace(arch, head_dim=arch.rotary_dim,
                                               partial_rotary_factor=1.0), rope_factors)
        return torch.cat((inv_freq, inv_freq.new_zeros((arch.head_dim - arch.rotary_dim) // 2)))
    dim = arch.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (arch.rope_theta**exponents)  # [head_dim / 2]
    scaling = arch.rope_scaling
    if rope_factors is not None:
        return inv_freq / rope_factors.float()
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling.factor, scaling.low_freq_factor,
                                   scaling.high_freq_factor,
                                   scaling.original_max_position_embeddings)
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(inv_freq, scaling, dim, arch.rope_theta)
    return inv_freq


def proportional_frequencies(theta: float, head_dim: int, num_turning: int) -> torch.Tensor:
    """Gemma 4's "proportional" RoPE: the first `num_turning` pairs at theta^(-2i / head_dim)
    (the exponent over the whole head), the others still (transformers'
    `_compute_proportional_rope_parameters`)."""
    exponents = torch.arange(0, 2 * num_turning, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return torch.cat((inv_freq, inv_freq.new_zeros(head_dim // 2 - num_turning)))


def attention_scaling(arch: ArchConfig) -> float:
    """What cos and sin are multiplied by: YaRN's scale, else 1 (transformers'
    `attention_scaling`, the second value of its rope initializers)."""
    scaling = arch.rope_scaling
    if scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) \
            / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def _yarn_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling, dim: int,
                      base: float) -> torch.Tensor:
    """YaRN: pairs that turn more than beta_fast times over the original context keep their
    speed, those under beta_slow are divided by the factor, a linear ramp blends between."""
    def correction_dim(rotations: float) -> float:
        context = scaling.original_max_position_embeddings
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the speed), 0: interpolate (divide by the factor)
    # 1 / (factor * base^(2i/d)), not inv_freq / factor: the same roundings as transformers
    speeds = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    return 1.0 / (scaling.factor * speeds) * (1 - keep) + inv_freq * keep


def _llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                        high_freq_factor: float, old_context_len: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend those in between."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """A [max_positions, head_dim] cos/sin table; one lookup per step serves every layer.

    The fused path (fused_ops.py: rope_store) reads rows of `cos_table` and `sin_table` by
    position itself, no lookup: each row holds the angles twice (halves equal), as here."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype,
                 device: torch.device, scale: float = 1.0) -> None:
        """`scale` multiplies cos and sin (YaRN's `attention_scaling`), in float32 before the
        cast, as transformers does."""
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos_table = (angles.cos() * scale).to(device=device, dtype=dtype)
        self.sin_table = (angles.sin() * scale).to(device=device, dtype=dtype)

    def rows_3d(self, positions_3d: torch.Tensor, axes: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Multimodal RoPE's cos and sin rows [T, head_dim]: column c of a token's row is the
        table's at the position of its axis `axes[c]` (0 t, 1 h, 2 w) in `positions_3d`
        [3, T] (transformers' apply_interleaved_mrope, as rows of this table)."""
        index = axes[None, None, :].expand(1, positions_3d.shape[1], -1)
        cos = self.cos_table[positions_3d].gather(0, index)[0]  # [T, head_dim]
        sin = self.sin_table[positions_3d].gather(0, index)[0]
        return cos, sin

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, shaped [num_tokens, 1, head_dim] to broadcast over heads."""
        cos = self.cos_table.index_select(0, positions).unsqueeze(1)
        sin = self.sin_table.index_select(0, positions).unsqueeze(1)
        return cos, sin


class StepRotary(RotaryEmbedding):
    """One step's own cos/sin rows [T, head_dim] standing in for a RotaryEmbedding's table
    (multimodal RoPE: token i reads row i, whichever op table runs)."""

    def __init__(self, cos_rows: torch.Tensor, sin_rows: torch.Tensor) -> None:
        self.cos_table, self.sin_table = cos_rows, sin_rows


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of `x` [num_tokens, num_heads, head_dim] (the HF layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def mrope_axes(arch: ArchConfig) -> torch.Tensor:
    """The position axis (0 t, 1 h, 2 w) of each column of a RoPE table row [head_dim]: with
    `mrope_interleaved` pair j turns with h where j % 3 == 1 and j < 3 * sections[1], with w
    where j % 3 == 2 and j < 3 * sections[2], else with t (Qwen3-VL, Qwen3.5); otherwise the
    sections run one after another (Qwen2-VL). Pairs past the sections (partial rotary's
    still dims) take t."""
    half = arch.head_dim // 2
    axes = torch.zeros(half, dtype=torch.int64)
    sections = arch.mrope_section
    if arch.mrope_interleaved:
        for axis in (1, 2):
            axes[axis : 3 * sections[axis] : 3] = axis
    else:
        start = 0
        for axis, length in enumerate(sections[:3]):
            axes[start : start + length] = axis
            start += length
    return torch.cat((axes, axes))

"""What a model's decoder layer computes beyond Llama's, declared once from its arch config.

Every dense family nanoserve serves runs one layer with a few switches: Qwen2's qkv bias,
Qwen3's and Gemma 3's q/k norms, Gemma 3's sandwich norms (the attention's and the MLP's
outputs normed before they join the residual stream), its GELU-tanh gate, its query scale, and
per layer a sliding window (Mistral: every layer; Gemma 3: five of six) with, in Gemma 3, the
windowed layers' own RoPE base. The Python layer loop (llama.py), the forward plan and the
native layer stack (native_layers.py) all read these, so a family's layer is described in one
place and every path runs the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.model.arch import ArchConfig

SILU, GELU_TANH = "silu", "gelu_tanh"  # the gate's activation: act(gate) * up


@dataclass(frozen=True)
class LayerFeatures:
    """A family's layer, as switches; per-layer ones are tuples indexed by layer."""

    has_qkv_bias: bool
    has_qk_norm: bool
    has_sandwich_norms: bool  # attention and MLP outputs normed before the residual add
    activation: str  # SILU | GELU_TANH
    # what q is multiplied by before attention, whose kernels scale q · k by 1 / sqrt(head_dim)
    # (Gemma's query_pre_attn_scalar; 1.0 where it is head_dim, and q is left as it is)
    q_scale: float
    windows: tuple[int, ...]  # per layer: the keys it attends (0: the whole context)
    uses_local_rope: tuple[bool, ...]  # per layer: the windowed layers' own RoPE table

    @classmethod
    def of(cls, arch: ArchConfig) -> LayerFeatures:
        windows = tuple(arch.layer_window(i) for i in range(arch.num_layers))
        has_local_base = arch.rope_local_theta is not None
        scalar = arch.query_pre_attn_scalar or arch.head_dim  # exactly 1.0 where it is head_dim
        q_scale = 1.0 if scalar == arch.head_dim else arch.attention_scale * arch.head_dim ** 0.5
        return cls(has_qkv_bias=arch.has_qkv_bias, has_qk_norm=arch.has_qk_norm,
                   has_sandwich_norms=arch.has_sandwich_norms, activation=arch.hidden_act,
                   q_scale=q_scale, windows=windows,
                   uses_local_rope=tuple(bool(w) and has_local_base for w in windows))

    @property
    def has_windows(self) -> bool:
        return any(self.windows)

    @property
    def has_local_rope(self) -> bool:
        return any(self.uses_local_rope)

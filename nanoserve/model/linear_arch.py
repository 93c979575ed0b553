"""The Gated DeltaNet part of a hybrid model's shape (Qwen3.5/3.6, Qwen3-Next), read from
`config.json` or GGUF metadata.

A hybrid model interleaves two layer kinds (`ArchConfig.layer_types`): gated full attention
(`FULL`, its KV in the paged cache) and Gated DeltaNet (`LINEAR`), a linear-attention
recurrence whose whole past is two fixed-size states per sequence: the last `conv_kernel - 1`
inputs of a short causal depthwise convolution over q, k and v, and a [key_head_dim,
value_head_dim] matrix per value head. Value heads share key heads in groups, like GQA's query
heads: Hugging Face checkpoints put value head j on key head j // (value heads per key head);
llama.cpp's GGUF converter reorders them "tiled", value head j on key head j % key heads.

llama.cpp's `qwen35` / `qwen35moe` files (conversion/qwen.py, Qwen3NextModel's
set_gguf_parameters) name the shape after Mamba's keys: `ssm.conv_kernel`, `ssm.state_size` (the
key head dim), `ssm.group_count` (key heads), `ssm.time_step_rank` (value heads) and
`ssm.inner_size` (value heads x value head dim); the layer kinds are
`attention.recurrent_layers` (a bool per block, True for Gated DeltaNet) or, without it,
`full_attention_interval` (src/models/qwen35.cpp, load_arch_hparams). A file's last
`nextn_predict_layers` blocks are the multi-token-prediction head (`blk.N.nextn.*`), which
nanoserve does not run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LINEAR = "linear_attention"  # transformers' `layer_types` value of a Gated DeltaNet layer


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The shape of a model's Gated DeltaNet layers (every one has the same)."""

    conv_kernel: int  # the causal conv's width: its state keeps conv_kernel - 1 inputs
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    v_heads_tiled: bool = False  # value head j reads key head j % num_key_heads (GGUF)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k (key_dim each) and v (value_dim), in that order."""
        return 2 * self.key_dim + self.value_dim

    def key_head_of(self, value_head: int) -> int:
        if self.v_heads_tiled:
            return value_head % self.num_key_heads
        return value_head // (self.num_value_heads // self.num_key_heads)

    @property
    def state_floats(self) -> int:
        """float32 values one sequence's state takes in one layer (conv and recurrent)."""
        return (self.conv_dim * (self.conv_kernel - 1)
                + self.num_value_heads * self.key_head_dim * self.value_head_dim)


def linear_from_hf(cfg: dict[str, Any]) -> LinearAttentionConfig:
    return LinearAttentionConfig(
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        value_head_dim=int(cfg.get("linear_value_head_dim", 128)))


def hybrid_layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    """`layer_types`, or transformers' default: every `full_attention_interval`-th layer full."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    interval = int(cfg.get("full_attention_interval", 4))
    return tuple("full_attention" if (i + 1) % interval == 0 else LINEAR
                 for i in range(cfg["num_hidden_layers"]))


def linear_from_gguf(get: Callable[..., Any]) -> LinearAttentionConfig:
    """The DeltaNet shape from a `qwen35`/`qwen35moe` file's `ssm.*` keys (`get(key)` reads
    `{arch}.key`); value heads in the converter's tiled order (when key and value heads are
    as many, tiled and grouped are the same order)."""
    num_value_heads = int(get("ssm.time_step_rank"))
    return LinearAttentionConfig(
        conv_kernel=int(get("ssm.conv_kernel")),
        num_key_heads=int(get("ssm.group_count")),
        num_value_heads=num_value_heads,
        key_head_dim=int(get("ssm.state_size")),
        value_head_dim=int(get("ssm.inner_size")) // num_value_heads,
        v_heads_tiled=True)


def gguf_num_layers(get: Callable[..., Any]) -> int:
    """The decoder layers nanoserve runs: `block_count` less the MTP blocks after them."""
    return int(get("block_count")) - int(get("nextn_predict_layers") or 0)


def gguf_hybrid_layer_types(get: Callable[..., Any]) -> tuple[str, ...]:
    """Each decoder layer's kind, as llama.cpp's qwen35 loader decides it: the file's
    `attention.recurrent_layers` flags, else every `full_attention_interval`-th layer full
    (4 where the file says neither)."""
    num_layers = gguf_num_layers(get)
    flags = get("attention.recurrent_layers")
    if flags is None:
        interval = int(get("full_attention_interval") or 4)
        flags = [(i + 1) % interval != 0 for i in range(num_layers)]
    return tuple(LINEAR if flag else "full_attention" for flag in flags[:num_layers])


def hybrid_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ArchConfig fields of a Qwen3.5 text config: its layer kinds, DeltaNet shape, gated
    attention and partial rotary (mRoPE's text positions are plain RoPE: every section gets
    the same position)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return {"layer_types": hybrid_layer_types(cfg), "linear": linear_from_hf(cfg),
            "has_attn_output_gate": True, "partial_rotary_factor": float(factor),
            # (transformers' Qwen3_5TextRotaryEmbedding: these sections, always interleaved,
            # where the config names none)
            "mrope_section": tuple(int(n) for n in params.get("mrope_section") or (11, 11, 10)),
            "mrope_interleaved": True}


def hybrid_from_gguf(get: Any, default_head_dim: int) -> dict[str, Any]:
    """The ArchConfig fields of a `qwen35`/`qwen35moe` file (linear_arch.py reads its DeltaNet
    keys): the rotary share is `rope.dimension_count` over the head dim, the gate in q's rows
    as in Hugging Face's q_proj (llama.cpp's qwen35.cpp views each head's 2 * D rows as the
    query, then the gate)."""
    head_dim = int(get("attention.key_length") or default_head_dim)
    # llama.cpp's sections (four, the last unused by qwen35) turn interleaved (IMROPE)
    sections = tuple(int(n) for n in get("rope.dimension_sections") or () if n)
    return {"layer_types": gguf_hybrid_layer_types(get), "linear": linear_from_gguf(get),
            "has_attn_output_gate": True,
            "partial_rotary_factor": int(get("rope.dimension_count") or head_dim) / head_dim,
            "mrope_section": sections, "mrope_interleaved": bool(sections)}

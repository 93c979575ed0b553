"""gpt-oss's shape (transformers' `GptOssConfig`, llama.cpp's `gpt-oss` GGUF keys), beyond the
Llama-family fields arch.py reads for every model.

A gpt-oss layer is a Llama layer with biases on q/k/v and o, a learned attention sink per query
head, sliding (128) and full layers alternating (even layers slide), YaRN positions (not
truncated: the ramp's ends stay fractional, as transformers computes it for the hub's
`truncate: false`), and a mixture of experts in place of the MLP: a router with a bias, the top
k logits softmaxed, experts with biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702
gate), gate clamped above and up both ways at `swiglu_limit`). gpt_oss_layers.py runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from nanoserve.model.rope_scaling import (
    RopeScaling,
    UnsupportedModelError,
    gguf_rope_scaling,
    rope_scaling_of,
)

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssExperts:
    """What a gpt-oss layer adds to ArchConfig: its experts and their activation."""

    num_experts: int
    num_experts_per_tok: int
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """Even layers slide, odd ones see everything (transformers' and llama.cpp's default)."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers))


def gpt_oss_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """ArchConfig's fields of a gpt-oss config.json (old `rope_scaling`/`rope_theta` keys, as
    the hub's, or transformers 5's `rope_parameters`)."""
    quant = cfg.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
        raise UnsupportedModelError(
            f"gpt-oss with quant_method={quant.get('quant_method')!r} is not supported; "
            "nanoserve reads its MXFP4 experts or unquantized weights")
    num_layers = cfg["num_hidden_layers"]
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 150000.0
    scaling = rope_scaling_of(cfg)
    eos = cfg.get("eos_token_id")
    return dict(
        family="gpt_oss", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=num_layers,
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False), has_qkv_bias=True,
        has_qk_norm=False, rope_scaling=scaling, sliding_window=cfg.get("sliding_window", 128),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        layer_types=tuple(cfg.get("layer_types") or default_layer_types(num_layers)),
        gpt_oss=GptOssExperts(num_experts=cfg["num_local_experts"],
                              num_experts_per_tok=cfg.get("num_experts_per_tok", 4),
                              swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                              swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702))))


def gpt_oss_from_gguf(get: Any, num_layers: int) -> dict[str, Any]:
    """The fields llama.cpp's `gpt-oss.*` keys give beyond the common ones. The window's period
    is `attention.sliding_window_pattern` where a file has it (default 2: even layers slide).
    YaRN: GGUF has no `truncate` key and llama.cpp rounds the ramp's ends; the model was
    trained with them unrounded (openai/gpt-oss, transformers' `truncate: false`), which is
    what runs here for a file too."""
    period = int(get("attention.sliding_window_pattern") or 2)
    scaling: RopeScaling = _untruncated(get)
    return dict(
        intermediate_size=int(get("expert_feed_forward_length")
                              or get("feed_forward_length")),
        has_qkv_bias=True, has_qk_norm=False, rope_scaling=scaling,
        sliding_window=int(get("attention.sliding_window") or 128),
        layer_types=tuple(SLIDING if i % period == 0 else FULL for i in range(num_layers)),
        moe=None,
        gpt_oss=GptOssExperts(num_experts=int(get("expert_count")),
                              num_experts_per_tok=int(get("expert_used_count") or 4)))


def _untruncated(get: Any) -> RopeScaling:
    """The file's YaRN with its ramp's ends unrounded (see gpt_oss_from_gguf). llama.cpp's
    converter writes no attn_factor for gpt-oss: transformers' default (0.1 ln(factor) + 1)
    holds."""
    scaling = gguf_rope_scaling(get)
    return replace(scaling, truncate=False) if scaling.rope_type == "yarn" else scaling

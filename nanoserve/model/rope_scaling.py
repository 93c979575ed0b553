"""Rope scaling as a checkpoint gives it (`rope_scaling` / `rope_parameters` in config.json,
a GGUF file's `rope.scaling.*` keys), read into one `RopeScaling`; what arch.py reads a
model's shape with, apart so that file stays the shape itself."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# GGUF `rope.scaling.type` -> ours (llama.cpp's names); anything else is refused by name
GGUF_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but describes something nanoserve cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (`rope_scaling` / `rope_parameters` in config.json)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (Qwen3 past 32k, gpt-oss): the ramp between the rotations beta_fast and beta_slow,
    # and the cos/sin scale (None: from the factor, as transformers infers it)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def rope_scaling_of(cfg: dict[str, Any]) -> RopeScaling:
    """Accept both the old `rope_scaling` dict and transformers 5's `rope_parameters`."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling {rope_type!r}; "
            f"nanoserve supports {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeScaling()
    original = int(params.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 8192))
    factor = params.get("factor")
    if factor is None and rope_type == "yarn":  # DeepSeek-style: the ratio of the contexts
        factor = cfg.get("max_position_embeddings", original) / original
    if factor is None:
        raise UnsupportedModelError(f"rope scaling {rope_type!r} needs a 'factor'")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=_optional_float(params.get("attention_factor")),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def gguf_rope_scaling(get: Any) -> RopeScaling:
    """llama.cpp's `rope.scaling.*` keys. YaRN's `attn_factor` multiplies the scale llama.cpp
    derives from the factor (ggml's rope_yarn), so it becomes transformers' attention_factor
    only times that scale; an unknown type is refused by name, never run as plain rope."""
    kind = get("rope.scaling.type")
    if kind is None:
        return RopeScaling()
    if kind not in GGUF_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported GGUF rope scaling type {kind!r}; nanoserve supports "
            f"{sorted(GGUF_ROPE_TYPES)}")
    rope_type = GGUF_ROPE_TYPES[kind]
    if rope_type == "default":
        return RopeScaling()
    factor = float(get("rope.scaling.factor", 1.0))
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=factor)
    attn_factor = get("rope.scaling.attn_factor")
    return RopeScaling(
        rope_type="yarn", factor=factor,
        original_max_position_embeddings=int(get("rope.scaling.original_context_length")
                                             or get("context_length", 4096)),
        beta_fast=float(get("rope.scaling.yarn_beta_fast") or 32.0),
        beta_slow=float(get("rope.scaling.yarn_beta_slow") or 1.0),
        attention_factor=None if attn_factor is None
        else float(attn_factor) * yarn_mscale(factor))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's cos/sin scale for a context `factor` (the paper's Eq. 21; 1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

"""Gemma 4's tensors, under transformers' names (both sources give those: weights.py), into
the places of `Gemma4Layer` (gemma4_layers.py) and the model's per-layer embedding parts.

Per layer: q, k and v fused into one matmul (a K = V layer's v rows are k's again: the same
rows give the same products; a KV-shared layer has q only, and any k/v tensors a checkpoint
still carries for it are dropped, as transformers ignores them), gate and up fused, the four
sandwich norms, the per-layer-input gate, projection and norm, the layer scalar, and the MoE
block's router, scales, norms and experts (`experts.gate_up_proj` [E, 2I, H] holds gate then
up: the fused order the layer's GeGLU splits).
"""

from __future__ import annotations

from typing import Any

from nanoserve.model.arch import ArchConfig
from nanoserve.model.quantization import fuse_rows

# transformers' name (after `model.layers.N.`) -> the place in Gemma4Layer
_LAYER_PLACES = {
    "input_layernorm.weight": "input_layernorm",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "attn_output_norm",
    "pre_feedforward_layernorm.weight": "post_attention_layernorm",
    "post_feedforward_layernorm.weight": "mlp_output_norm",
    "mlp.down_proj.weight": "down_proj",
    "layer_scalar": "layer_scalar",
    "per_layer_input_gate.weight": "ple_gate",
    "per_layer_projection.weight": "ple_proj",
    "post_per_layer_input_norm.weight": "ple_norm",
    "router.proj.weight": "moe.router",
    "router.scale": "moe.router_scale",
    "router.per_expert_scale": "moe.per_expert_scale",
    "pre_feedforward_layernorm_2.weight": "moe.pre_norm",
    "post_feedforward_layernorm_1.weight": "moe.dense_out_norm",
    "post_feedforward_layernorm_2.weight": "moe.experts_out_norm",
}
# the model's own
MODEL_PLACES = {
    "model.embed_tokens_per_layer.weight": "embed_tokens_per_layer",
    "model.per_layer_model_projection.weight": "per_layer_model_projection",
    "model.per_layer_projection_norm.weight": "per_layer_projection_norm",
}
_SHARED_LAYER_EXTRAS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                        "self_attn.k_norm.weight", "self_attn.v_norm.weight")


def pop_gemma4_layer(state: dict[str, Any], arch: ArchConfig, i: int) -> dict[str, Any]:
    """Layer i's tensors out of `state` (HF names), keyed by their places in the model."""
    layers = arch.gemma4
    assert layers is not None
    p, out = f"model.layers.{i}.", {}
    place = f"layers.{i}."
    for name, where in _LAYER_PLACES.items():
        if p + name in state:
            out[place + where] = state.pop(p + name)
    q = state.pop(p + "self_attn.q_proj.weight")
    if layers.owns_kv(i):
        k = state.pop(p + "self_attn.k_proj.weight")
        v = k if layers.k_eq_v[i] else state.pop(p + "self_attn.v_proj.weight")
        out[place + "qkv_proj"] = fuse_rows([q, k, v])
        out[place + "k_norm"] = state.pop(p + "self_attn.k_norm.weight")
    else:
        out[place + "qkv_proj"] = q
        for extra in _SHARED_LAYER_EXTRAS:
            state.pop(p + extra, None)
    out[place + "gate_up_proj"] = fuse_rows([state.pop(p + "mlp.gate_proj.weight"),
                                             state.pop(p + "mlp.up_proj.weight")])
    if layers.has_moe:
        out.update(_pop_experts(state, p, place))
    return out


def _pop_experts(state: dict[str, Any], p: str, place: str) -> dict[str, Any]:
    """The experts, stacked ([E, 2I, H] gate then up, [E, H, I]) or one tensor per expert
    (a GGUF file's, split by weights.py: `experts.E.gate_up_proj` / `.down_proj`)."""
    out: dict[str, Any] = {}
    stacked = state.pop(p + "experts.gate_up_proj", None)
    if stacked is not None:
        down = state.pop(p + "experts.down_proj")
        for e in range(stacked.shape[0]):
            out[f"{place}moe.experts.{e}.gate_up_proj"] = stacked[e]
            out[f"{place}moe.experts.{e}.down_proj"] = down[e]
        return out
    prefix = p + "experts."
    parts: dict[str, dict[str, Any]] = {}
    for name in [n for n in state if n.startswith(prefix)]:
        expert, _, part = name[len(prefix):].partition(".")
        parts.setdefault(expert, {})[part.removesuffix(".weight")] = state.pop(name)
    for expert, held in parts.items():
        if "gate_up_proj" not in held:  # the file's gate and up apart: fused here
            held["gate_up_proj"] = fuse_rows([held.pop("gate_proj"), held.pop("up_proj")])
        for part, value in held.items():
            out[f"{place}moe.experts.{expert}.{part}"] = value
    return out

"""Gemma 4's layer shapes, read from a `config.json` (transformers' and the hub's spellings) or
from llama.cpp's `gemma4` GGUF keys.

What Gemma 4's text model adds to Gemma 3's layer, each read on its own so any combination
transformers accepts runs (not only E2B, E4B, 26B-A4B and 31B):

- per-layer head shapes: windowed layers have `head_dim` and `num_key_value_heads`, global ones
  `global_head_dim` and, where `attention_k_eq_v`, `num_global_key_value_heads` (transformers
  5.25 writes these as `per_layer_config` entries instead: both are read);
- K = V on global layers where `attention_k_eq_v` (no v_proj: the value is the key's
  projection, normed without weight and not turned);
- KV sharing: the last `num_kv_shared_layers` layers read the cache of the last earlier layer
  of their kind and own none (transformers' `kv_sharing_modes`);
- per-layer embeddings (`hidden_size_per_layer_input` P > 0): a [vocab, L * P] table and a
  projection of the embedding give each layer a P-wide input, joined through a gated residual;
- a double-wide MLP on the KV-shared layers (`use_double_wide_mlp`), a MoE block beside the
  dense MLP (`enable_moe_block`), the final logit softcap;
- proportional RoPE on global layers: the first `partial_rotary_factor * head_dim / 2` pairs
  turn, with exponents over the whole head, the others stay still.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nanoserve.model.rope_scaling import UnsupportedModelError

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_FULL_ROTARY_FACTOR = 0.25  # transformers' default "proportional" share


@dataclass(frozen=True)
class Gemma4Layers:
    """Per layer (tuples indexed by layer): what differs between Gemma 4's layers."""

    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    # the layer whose KV cache each layer reads: itself, or (a KV-shared layer) the last
    # earlier layer of its kind that computes keys and values
    kv_sources: tuple[int, ...]
    k_eq_v: tuple[bool, ...]  # the value is the key's projection (no v_proj)
    intermediate_sizes: tuple[int, ...]
    per_layer_input_size: int = 0  # P; 0: no per-layer embeddings
    final_logit_softcap: float | None = None
    full_rotary_factor: float = DEFAULT_FULL_ROTARY_FACTOR  # the turning share on global layers
    num_experts: int = 0  # a MoE block beside the dense MLP where > 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def owns_kv(self, layer: int) -> bool:
        """Layer `layer` computes and stores keys and values (not a KV-shared layer)."""
        return self.kv_sources[layer] == layer

    @property
    def kv_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self.kv_sources)) if self.owns_kv(i))

    @property
    def has_moe(self) -> bool:
        return self.num_experts > 0


def kv_sources(layer_types: tuple[str, ...], num_shared: int) -> tuple[int, ...]:
    """Each layer's cache owner: transformers' `kv_sharing_modes` as indices. Every kind a
    shared layer has must have an earlier owner (transformers raises otherwise; so do we)."""
    first_shared = len(layer_types) - num_shared
    sources = list(range(len(layer_types)))
    last_owner = {kind: i for i, kind in enumerate(layer_types[:first_shared])}
    for i in range(first_shared, len(layer_types)):
        if layer_types[i] not in last_owner:
            raise UnsupportedModelError(
                f"Gemma 4 layer {i} ({layer_types[i]}) shares the KV cache of an earlier "
                f"layer of its kind, but none of the first {first_shared} layers is one")
        sources[i] = last_owner[layer_types[i]]
    return tuple(sources)


def gemma4_from_hf(cfg: dict[str, Any], layer_types: tuple[str, ...]) -> dict[str, Any]:
    """ArchConfig's Gemma 4 fields from a text config (`gemma4_text`)."""
    num_layers = len(layer_types)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    num_kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    global_dim = cfg.get("global_head_dim")
    global_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
    if not overrides:  # the hub's spelling: transformers builds the same overrides
        global_dim = global_dim or 512
        overrides = {i: {"head_dim": global_dim,
                         **({} if global_kv is None else {"num_key_value_heads": global_kv})}
                     for i, kind in enumerate(layer_types) if kind == FULL}
    head_dims = tuple(overrides.get(i, {}).get("head_dim", head_dim) for i in range(num_layers))
    kv_heads = tuple(overrides.get(i, {}).get("num_key_value_heads", num_kv)
                     for i in range(num_layers))
    num_shared = cfg.get("num_kv_shared_layers") or 0
    sources = kv_sources(layer_types, num_shared)
    intermediate = cfg["intermediate_size"]
    wide = bool(cfg.get("use_double_wide_mlp"))
    sizes = tuple(intermediate * (2 if wide and sources[i] != i else 1) for i in range(num_layers))
    params = cfg.get("rope_parameters") or {}
    full_rope: dict[str, Any] = params[FULL] if isinstance(params.get(FULL), dict) else {}
    if full_rope.get("rope_type", "proportional") not in ("proportional", "default"):
        raise UnsupportedModelError(
            f"Gemma 4 with {full_rope['rope_type']!r} RoPE on its global layers is not "
            "supported; nanoserve runs 'proportional'")
    factor = float(full_rope.get("partial_rotary_factor", DEFAULT_FULL_ROTARY_FACTOR)
                   if full_rope.get("rope_type", "proportional") == "proportional" else 1.0)
    moe = bool(cfg.get("enable_moe_block"))
    if cfg.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("Gemma 4 with bidirectional attention (an encoder) is "
                                    "not a generative model nanoserve runs")
    layers = Gemma4Layers(
        head_dims=head_dims, kv_heads=kv_heads, kv_sources=sources,
        k_eq_v=tuple(k_eq_v and kind == FULL for kind in layer_types),
        intermediate_sizes=sizes, per_layer_input_size=cfg.get("hidden_size_per_layer_input") or 0,
        final_logit_softcap=cfg.get("final_logit_softcapping"), full_rotary_factor=factor,
        num_experts=(cfg.get("num_experts") or 0) if moe else 0,
        num_experts_per_tok=(cfg.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=(cfg.get("moe_intermediate_size") or 0) if moe else 0)
    if cfg.get("vocab_size_per_layer_input", cfg["vocab_size"]) != cfg["vocab_size"] \
            and layers.per_layer_input_size:
        raise UnsupportedModelError("Gemma 4 with a per-layer vocabulary unlike its own is not "
                                    "supported")
    return {"gemma4": layers, "head_dim": head_dim, "num_kv_heads": num_kv,
            "rope_theta": float(full_rope.get("rope_theta") or 1e6),
            "rope_local_theta": float(((params.get(SLIDING) or {}).get("rope_theta")) or 1e4)}


def gemma4_from_gguf(get: Callable[..., Any], num_layers: int,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None) -> dict[str, Any]:
    """ArchConfig's Gemma 4 fields from llama.cpp's `gemma4.*` keys (conversion/gemma.py's
    Gemma4Model writes them) and the file's tensors (a global layer without `attn_v` is K = V;
    a KV-shared one has no `attn_k`)."""
    shapes = tensor_shapes or {}
    pattern = get("attention.sliding_window_pattern")
    is_sliding = (list(pattern) if isinstance(pattern, (list, tuple))
                  else [(i + 1) % 6 != 0 for i in range(num_layers)])
    layer_types = tuple(SLIDING if s else FULL for s in is_sliding)
    full_dim = int(get("attention.key_length"))
    swa_dim = int(get("attention.key_length_swa") or full_dim)
    kv = get("attention.head_count_kv")
    kv_per_layer = (tuple(int(x) for x in kv) if isinstance(kv, (list, tuple))
                    else (int(kv),) * num_layers)
    ff = get("feed_forward_length")
    sizes = (tuple(int(x) for x in ff) if isinstance(ff, (list, tuple))
             else (int(ff),) * num_layers)
    sources = kv_sources(layer_types, int(get("attention.shared_kv_layers") or 0))
    experts = int(get("expert_count") or 0)
    swa_kv = next((kv_per_layer[i] for i in range(num_layers) if is_sliding[i]), kv_per_layer[0])
    layers = Gemma4Layers(
        head_dims=tuple(swa_dim if s else full_dim for s in is_sliding), kv_heads=kv_per_layer,
        kv_sources=sources,
        k_eq_v=tuple(not is_sliding[i] and sources[i] == i
                     and f"blk.{i}.attn_v.weight" not in shapes and bool(shapes)
                     for i in range(num_layers)),
        intermediate_sizes=sizes, per_layer_input_size=int(
            get("embedding_length_per_layer_input") or 0),
        final_logit_softcap=get("final_logit_softcapping"),
        num_experts=experts, num_experts_per_tok=int(get("expert_used_count") or 0),
        moe_intermediate_size=int(get("expert_feed_forward_length") or 0) if experts else 0)
    return {"gemma4": layers, "head_dim": swa_dim, "num_kv_heads": swa_kv,
            "layer_types": layer_types, "intermediate_size": max(sizes),
            "rope_local_theta": float(get("rope.freq_base_swa") or 1e4),
            "sliding_window": int(get("attention.sliding_window") or 512)}


def full_rotary_pairs(layers: Gemma4Layers, full_head_dim: int,
                      rope_factors: Any = None) -> int:
    """The pairs a global layer turns: the config's share, or where a GGUF file gives
    llama.cpp's `rope_freqs` (1.0 for a turning pair, 1e30 for a still one), its count."""
    if rope_factors is not None:
        return int((rope_factors < 1e20).sum())
    return int(layers.full_rotary_factor * full_head_dim // 2)

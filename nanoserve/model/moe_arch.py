"""The mixture-of-experts part of a model's shape (Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE), read from
`config.json` or GGUF metadata.

A MoE layer replaces the dense MLP by `num_experts` small gated MLPs (each of
`moe_intermediate_size` rows) and a router: every token runs through its top `num_experts_per_tok`
experts, weighted by the router's softmax probabilities (renormalised over the chosen ones when
`norm_topk_prob`), plus, in Qwen2-MoE and Qwen3.5-MoE, a shared expert that every token runs,
scaled by a sigmoid gate. Which layers are MoE: transformers' rule for `config.json`
(`decoder_sparse_step`, and `mlp_only_layers` kept dense); for GGUF the file's own tensors (a
layer with a router, `blk.N.ffn_gate_inp`, is MoE), and every layer when they are not given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# GGUF architecture -> whether its router renormalises the top-k weights when the file does not
# say (`{arch}.expert_weights_norm`): llama.cpp's qwen3moe does, its qwen2moe does not; its
# qwen35moe always does, whatever the file says (src/models/qwen35moe.cpp: build_moe_ffn with
# norm_w true and a softmax router; the converter writes neither key)
GGUF_NORM_TOPK_DEFAULT = {"qwen2moe": False, "qwen3moe": True, "qwen35moe": True}
_GGUF_ALWAYS_NORM_TOPK = ("qwen35moe",)
_GGUF_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


@dataclass(frozen=True)
class MoeConfig:
    """The experts of a MoE model, and which of its layers have them."""

    num_experts: int
    num_experts_per_tok: int  # k: experts a token runs through
    moe_intermediate_size: int  # one expert's MLP rows
    norm_topk_prob: bool  # renormalise the k weights to sum to 1
    sparse_layers: tuple[int, ...]  # indices of the MoE layers; the others are dense
    shared_expert_intermediate_size: int = 0  # 0: no shared expert (Qwen3-MoE)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def active_intermediate_size(self, dense_size: int, num_layers: int) -> int:
        """The MLP rows one token runs through in an average layer: k experts and the shared
        one in a MoE layer, `dense_size` in the others (for cost models, not for shapes)."""
        sparse = len(self.sparse_layers)
        per_moe_layer = (self.num_experts_per_tok * self.moe_intermediate_size
                         + self.shared_expert_intermediate_size)
        return (sparse * per_moe_layer + (num_layers - sparse) * dense_size) // num_layers


def moe_from_hf(cfg: dict[str, Any]) -> MoeConfig | None:
    """The MoE fields of a Qwen2-MoE / Qwen3-MoE `config.json` (None for a dense model), with
    transformers' rule for which layers are MoE (modeling_qwen3_moe.py's decoder layer)."""
    if cfg.get("model_type") not in ("qwen2_moe", "qwen3_moe", "qwen3_5_moe_text", "qwen3_next"):
        return None
    # Qwen3.5's router always renormalises its top k (its config has no norm_topk_prob)
    norm_default = cfg["model_type"] in ("qwen3_5_moe_text", "qwen3_next")
    # transformers 5 saves `num_local_experts`; the published checkpoints say `num_experts`
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(cfg["num_hidden_layers"])
                   if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", norm_default)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
    )


def moe_from_gguf(meta: dict[str, Any], num_layers: int,
                  tensor_shapes: Mapping[str, tuple[int, ...]] | None) -> MoeConfig | None:
    """The MoE fields of a `qwen2moe` / `qwen3moe` / `qwen35moe` GGUF file (None for another
    architecture).
    Sizes the metadata leaves out are read from the tensors' shapes where those are given."""
    arch = meta.get("general.architecture", "")
    if arch not in GGUF_NORM_TOPK_DEFAULT:
        return None

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    shapes = tensor_shapes or {}
    gating = get("expert_gating_func", _GGUF_SOFTMAX_GATING)
    if gating != _GGUF_SOFTMAX_GATING:
        raise ValueError(
            f"{arch}.expert_gating_func={gating}: nanoserve's router is a softmax "
            f"(gating function {_GGUF_SOFTMAX_GATING})")
    sparse = (tuple(range(num_layers)) if tensor_shapes is None else
              tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes))
    first = sparse[0] if sparse else 0
    experts_shape = shapes.get(f"blk.{first}.ffn_gate_exps.weight", (0, 0, 0))
    shared_shape = shapes.get(f"blk.{first}.ffn_gate_shexp.weight", (0, 0))
    return MoeConfig(
        num_experts=int(get("expert_count") or experts_shape[0]),
        num_experts_per_tok=int(get("expert_used_count")),
        moe_intermediate_size=int(get("expert_feed_forward_length") or experts_shape[1]),
        norm_topk_prob=arch in _GGUF_ALWAYS_NORM_TOPK
        or bool(get("expert_weights_norm", GGUF_NORM_TOPK_DEFAULT[arch])),
        sparse_layers=sparse,
        shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length")
                                            or shared_shape[0]),
    )

"""Gemma 4's GGUF tensors (llama.cpp arch `gemma4`) under transformers' names, the names
`Gemma4ForCausalLM.state_dict()` spells, so that a GGUF file and a safetensors checkpoint meet
in one dict (weights.py reads both).

What llama.cpp's converter (conversion/gemma.py `Gemma4Model` over `Gemma3Model`, gguf-py's
tensor map) writes, and what becomes of it here:

- every tensor is stored as transformers holds it, values and PyTorch-order shape alike: norm
  weights as `w` (Gemma 4's RMSNorm multiplies by w, not 1 + w: `norm_shift` is 0), Q and K
  rows unpermuted, `experts.gate_up_proj` [E, 2I, H] fused as `ffn_gate_up_exps` (gate rows
  then up rows, the order of both), `layer_scalar` [1] as `layer_output_scale.weight`, the
  router's `scale` [H] as `ffn_gate_inp.scale` and its `per_expert_scale` [E] as
  `ffn_down_exps.scale`. The name alone is the whole map: `gemma4_hf_name`.
- `token_embd` keeps only the tokenizer's rows (the converter drops rows past the vocabulary
  it writes): its row count, not config.json's `vocab_size`, is the vocabulary.
  `per_layer_token_embd` keeps all `vocab_size_per_layer_input` rows. The head is tied: no
  `output.weight` (mapped to `lm_head.weight` where a file has one).
- `rope_freqs` [global_head_dim / 2] is made by the converter, not read from the checkpoint:
  1 for the rotated pairs of the full-attention layers' proportional RoPE, 1e30 for the rest.
  The name maps to None (the loader derives the same RoPE from the config).
- Layers that reuse another layer's KV cache (the last `shared_kv_layers`) have no attn_k,
  attn_v, attn_k_norm, and K = V layers (`attention_k_eq_v`) no attn_v: transformers has none
  either.

Two other layouts llama.cpp's loader takes (src/models/gemma4.cpp falls back to split
experts; the converter's --fuse-qkv writes the other) hold one transformers tensor in two, or
three in one; `gemma4_hf_tensors` turns them back:

- `ffn_gate_exps` and `ffn_up_exps` [E, I, H] (the experts' gate and up apart): the two halves
  of `experts.gate_up_proj`; `gemma4_hf_name` names them `experts.gate_proj` and
  `experts.up_proj` (names transformers does not have), `join_gate_up_experts` joins them.
- `attn_qkv` (`--fuse-qkv`: q, k and v rows stacked, on the layers that have all three):
  `gemma4_hf_name` names it `self_attn.qkv_proj.weight`, `split_fused_qkv` cuts it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# the model's own tensors: GGUF name -> transformers' name (None: not read)
_GLOBAL_NAMES: dict[str, str | None] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "rope_freqs.weight": None,
}
# a layer's: GGUF name after `blk.N.` -> transformers' name after `model.layers.N.`
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    # the MoE block (26B-A4B): router, its two scales, the experts and their three norms
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    # the other layouts' pieces (module docstring), joined or cut by gemma4_hf_tensors
    "ffn_gate_exps.weight": "experts.gate_proj",
    "ffn_up_exps.weight": "experts.up_proj",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
}
GATE_EXPERTS, UP_EXPERTS = "experts.gate_proj", "experts.up_proj"
FUSED_QKV = "self_attn.qkv_proj.weight"
Q_NORM = "self_attn.q_norm.weight"


def gemma4_hf_name(gguf_name: str) -> str | None:
    """The transformers name of a `gemma4` GGUF tensor (`blk.3.ffn_gate_inp.scale` ->
    `model.layers.3.router.scale`); None for `rope_freqs.weight`, which the loader skips. The
    other layouts' pieces get the names in the module docstring. A name llama.cpp's gemma4
    does not have is a ValueError naming it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)  # blk, N, the rest
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a gemma4 GGUF file")


def join_gate_up_experts(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`experts.gate_up_proj` [E, 2I, H] from `ffn_gate_exps` and `ffn_up_exps` [E, I, H]:
    gate's rows then up's. Whole rows are stacked, so raw quantized blocks ([E, I, bytes per
    row] uint8) join the same way."""
    return torch.cat([gate, up], dim=1)


def split_fused_qkv(qkv: torch.Tensor, num_heads: int, head_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_proj, k_proj and v_proj from `attn_qkv` [(heads + 2 kv_heads) * head_dim, H]: the
    first num_heads * head_dim rows are q, the rest k then v, of equal size. Row slices, so
    raw blocks ([rows, bytes per row] uint8) cut the same way."""
    q_rows = num_heads * head_dim
    k_rows = (qkv.shape[0] - q_rows) // 2
    if k_rows <= 0 or q_rows + 2 * k_rows != qkv.shape[0]:
        raise ValueError(f"attn_qkv has {qkv.shape[0]} rows: not {q_rows} query rows and two "
                         f"equal key and value parts")
    return qkv[:q_rows], qkv[q_rows:q_rows + k_rows], qkv[q_rows + k_rows:]


def gemma4_hf_tensors(tensors: Iterable[tuple[str, torch.Tensor]], num_heads: int
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """A gemma4 file's tensors (GGUF name, value in PyTorch order, as read) as transformers'
    (name, value) pairs, whatever layout llama.cpp loads: names mapped, `rope_freqs` left
    out, the experts' gate and up joined into `experts.gate_up_proj` once both halves have
    come, a fused `attn_qkv` cut into q/k/v_proj once the layer's q_norm (whose length is the
    head width) has come too. `num_heads`: the file's `attention.head_count`. A half or an
    attn_qkv still unpaired at the end is a ValueError."""
    held: dict[str, torch.Tensor] = {}
    for gguf_name, value in tensors:
        name = gemma4_hf_name(gguf_name)
        if name is None:
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if rest == Q_NORM:
            held[name] = value  # its width cuts the layer's attn_qkv, if it has one
            yield name, value
        elif rest in (GATE_EXPERTS, UP_EXPERTS, FUSED_QKV):
            held[name] = value
        else:
            yield name, value
            continue
        yield from _completed(held, f"model.layers.{layer}.", num_heads)
    unpaired = [n for n in held if not n.endswith(Q_NORM)]
    if unpaired:
        raise ValueError(f"gemma4 tensors without their other part: {sorted(unpaired)}")


def _completed(held: dict[str, torch.Tensor], prefix: str, num_heads: int
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The layer's joined experts or cut attn_qkv, once `held` has both their parts."""
    gate, up = prefix + GATE_EXPERTS, prefix + UP_EXPERTS
    if gate in held and up in held:
        yield prefix + "experts.gate_up_proj", join_gate_up_experts(held.pop(gate), held.pop(up))
    qkv, q_norm = prefix + FUSED_QKV, prefix + Q_NORM
    if qkv in held and q_norm in held:
        parts = split_fused_qkv(held.pop(qkv), num_heads, held[q_norm].shape[0])
        for proj, part in zip(("q", "k", "v"), parts, strict=True):
            yield f"{prefix}self_attn.{proj}_proj.weight", part

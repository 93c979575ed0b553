"""Qwen3.5's (and Qwen3-Next's) multi-token-prediction head: its weights, read from a
checkpoint's `mtp.*` tensors, and its input projection.

The head predicts the token after next from the target's final normed hidden state at a
position and the embedding of the token that follows it (vLLM's Qwen3NextMultiTokenPredictor):

    x   = fc(concat(rms(embed(next_token), pre_fc_norm_embedding),
                    rms(target_hidden, pre_fc_norm_hidden)))     # [T, 2 * hidden] -> [T, hidden]
    out = rms(x + layer(x), norm)          # one full-attention decoder layer (gated attention,
                                           # the model's MLP or MoE), its own KV cache
    logits = lm_head(out)                  # the target's embedding and head, shared

`mtp.layers.0.*` is a decoder layer under the names a full-attention layer of the model has,
loaded here the way weights.py loads one (q's gate rows split out, partial-rotary dims
reordered, q/k/v and gate/up fused). Its norms are stored as offsets w (multiplied by 1 + w),
as the model's are (`ArchConfig.norms_are_offsets`), `pre_fc_norm_*` among them: each becomes
1 + w here. transformers' Qwen3.5 reads none of it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from nanoserve.model.arch import ArchConfig
from nanoserve.model.hybrid_weights import reorder_heads, split_gated_query
from nanoserve.model.layer_features import LayerFeatures
from nanoserve.model.llama import DecoderLayer
from nanoserve.model.moe_weights import pop_moe_weights
from nanoserve.model.quantization import (
    RawBlocks,
    as_float,
    fuse_rows,
    make_matmul_weight,
    shape_of,
)

MTP_PREFIX = "mtp."
ReadTensor = torch.Tensor | RawBlocks
Loaded = torch.Tensor | RawBlocks | list[RawBlocks]
_MATMULS = ("fc", "qkv_proj", "attn_gate_proj", "o_proj", "gate_up_proj", "down_proj")


class MtpHead(nn.Module):
    """The head's own weights (see the module); the embedding and LM head are the target's."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        hidden = arch.hidden_size
        self.fc = _param(hidden, 2 * hidden)  # [hidden, embedding ; target hidden]
        self.pre_fc_norm_embedding = _param(hidden)
        self.pre_fc_norm_hidden = _param(hidden)
        # a full-attention layer: the model's last one's features (window, MoE or not)
        self.layer = DecoderLayer(arch, arch.attention_layers[-1], LayerFeatures.of(arch))
        self.norm = _param(hidden)


def divert_mtp(tensors: Iterator[tuple[str, ReadTensor]], kept: dict[str, ReadTensor] | None
               ) -> Iterator[tuple[str, ReadTensor]]:
    """The checkpoint's tensors but `mtp.*`, which go into `kept` (None: dropped, as
    transformers drops them)."""
    for name, value in tensors:
        if not name.startswith(MTP_PREFIX):
            yield name, value
        elif kept is not None:
            kept[name] = value


def load_mtp_head(state: dict[str, ReadTensor], arch: ArchConfig, dtype: torch.dtype,
                  device: torch.device, quantization: str) -> MtpHead:
    """The head from `state` (the `mtp.*` tensors), its matmul weights held as the target's
    (`quantization`, the resolved mode); a ValueError names what is missing or extra."""
    head = MtpHead(arch)
    state = {name: 1.0 + value.float() if arch.norms_are_offsets and _is_norm(name)
             and isinstance(value, torch.Tensor) else value for name, value in state.items()}
    fused: dict[str, Loaded] = {}
    for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        fused[name] = _pop(state, f"{MTP_PREFIX}{name}.weight")
    fused.update(_pop_layer(state, arch, f"{MTP_PREFIX}layers.0.", "layer."))
    if state:
        raise ValueError(f"unexpected MTP weights in checkpoint: {sorted(state)[:5]} (one "
                         "MTP layer, mtp.layers.0, is read)")
    expected = dict(head.named_parameters())
    missing = sorted(set(expected) - set(fused))
    if missing:
        raise ValueError(f"checkpoint's MTP head is missing weights: {missing[:5]}")
    for name, value in fused.items():
        want = tuple(expected[name].shape)
        if shape_of(value) != want:
            raise ValueError(f"MTP weight {name}: checkpoint shape {shape_of(value)}, "
                             f"model expects {want}")
        if name.endswith(_MATMULS):
            _set(head, name, make_matmul_weight(value, quantization, dtype, device))
        else:
            _set(head, name, as_float(value).to(device=device, dtype=dtype).contiguous())
    return head.eval()


def _pop_layer(state: dict[str, ReadTensor], arch: ArchConfig, prefix: str, target: str
               ) -> dict[str, Loaded]:
    """The MTP decoder layer's tensors under DecoderLayer's names (weights.py's order)."""
    attn = prefix + "self_attn."
    out: dict[str, Loaded] = {
        target + "input_layernorm": _pop(state, prefix + "input_layernorm.weight"),
        target + "post_attention_layernorm": _pop(state,
                                                  prefix + "post_attention_layernorm.weight"),
        target + "o_proj": _pop(state, attn + "o_proj.weight"),
    }
    q, k, v = (_pop(state, f"{attn}{n}_proj.weight") for n in "qkv")
    q_norm = _pop(state, attn + "q_norm.weight") if arch.has_qk_norm else None
    k_norm = _pop(state, attn + "k_norm.weight") if arch.has_qk_norm else None
    if arch.has_attn_output_gate:
        q, out[target + "attn_gate_proj"] = split_gated_query(q, arch)
    if arch.rotary_dim < arch.head_dim:  # partial rotary as full (hybrid_weights.py)
        q, k = reorder_heads(q, arch, arch.num_heads), reorder_heads(k, arch, arch.num_kv_heads)
        q_norm = None if q_norm is None else reorder_heads(q_norm, arch, 1)
        k_norm = None if k_norm is None else reorder_heads(k_norm, arch, 1)
    out[target + "qkv_proj"] = fuse_rows([q, k, v])
    if q_norm is not None and k_norm is not None:
        out[target + "q_norm"], out[target + "k_norm"] = q_norm, k_norm
    if arch.moe is not None and arch.moe.is_sparse(arch.attention_layers[-1]):
        out.update(pop_moe_weights(state, prefix, target + "moe.", arch.moe))
    else:
        out[target + "gate_up_proj"] = fuse_rows([_pop(state, prefix + "mlp.gate_proj.weight"),
                                                  _pop(state, prefix + "mlp.up_proj.weight")])
        out[target + "down_proj"] = _pop(state, prefix + "mlp.down_proj.weight")
    return out


def _is_norm(name: str) -> bool:
    """An RMSNorm's weight (none of the head's matmul weights has "norm" in its name)."""
    return "norm" in name.rsplit(".", 2)[-2]


def _pop(state: dict[str, ReadTensor], name: str) -> ReadTensor:
    if name not in state:
        raise ValueError(f"checkpoint's MTP head has no {name!r}")
    return state.pop(name)


def _set(module: nn.Module, dotted_name: str, value: object) -> None:
    """weights.py's `_set_weight`: a tensor stays a Parameter, a quantized weight is a plain
    attribute."""
    owner_name, _, attr = dotted_name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if isinstance(value, torch.Tensor):
        setattr(owner, attr, nn.Parameter(value, requires_grad=False))
        return
    owner._parameters.pop(attr, None)
    setattr(owner, attr, value)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

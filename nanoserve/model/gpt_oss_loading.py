"""gpt-oss's tensors, from a safetensors checkpoint (bf16 or MXFP4 experts) or a GGUF file,
into the places of `GptOssLayer` (gpt_oss_layers.py).

The experts come three ways, and leave here as one matmul weight per expert with gate and up
fused as [gate; up] rows, the order the layer's SwiGLU splits:
- transformers' bf16: `experts.gate_up_proj` [E, hidden, 2I] (x @ W, gate and up interleaved
  column by column) and `down_proj` [E, I, hidden]: transposed, the rows de-interleaved;
- transformers' MXFP4: `*_blocks` [E, rows, K/32, 16] and `*_scales` [E, rows, K/32], rows the
  outputs (interleaved likewise): turned into GGUF MXFP4 blocks (mxfp4.py) of the same values,
  the kernel's type, its rows de-interleaved as they are (whole rows of blocks);
- GGUF (llama.cpp's converter de-interleaved them already): `ffn_{gate,up,down}_exps`, split
  per expert by weights.py, with their biases stacked [E, rows].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from nanoserve.model.arch import ArchConfig
from nanoserve.model.mxfp4 import GGML_MXFP4, hf_mxfp4_to_gguf_blocks
from nanoserve.model.quantization import RawBlocks, as_float, fuse_rows

# llama.cpp's gpt-oss tensor names (after `blk.N.`) -> transformers' (after `model.layers.N.`)
GGUF_GPT_OSS_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # (gpt-oss's norm before the experts)
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}


def gpt_oss_hf_name(name: str) -> str | None:
    """A gpt-oss GGUF tensor's transformers name (a sink's `weight` suffix dropped), or None
    for one the model does not read."""
    globals_ = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    if name in globals_:
        return globals_[name]
    parts = name.split(".", 2)  # blk, N, the rest
    if parts[0] != "blk" or len(parts) != 3:
        return None
    module, _, suffix = parts[2].partition(".")
    if module not in GGUF_GPT_OSS_NAMES:
        raise ValueError(f"unexpected gpt-oss GGUF tensor {name!r}")
    mapped = f"model.layers.{parts[1]}.{GGUF_GPT_OSS_NAMES[module]}"
    return mapped if module == "attn_sinks" else f"{mapped}.{suffix}"


def has_mxfp4_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint directory whose config says its experts are MXFP4."""
    config = path / "config.json"
    if not path.is_dir() or not config.exists():
        return False
    quant = json.loads(config.read_text()).get("quantization_config") or {}
    return quant.get("quant_method") == "mxfp4"


def pop_gpt_oss_layer(state: dict[str, Any], arch: ArchConfig, i: int) -> dict[str, Any]:
    """Layer i's tensors out of `state` (transformers' names), keyed by their places."""
    p, place = f"model.layers.{i}.", f"layers.{i}."
    attn = p + "self_attn."
    out: dict[str, Any] = {
        place + "input_layernorm": state.pop(p + "input_layernorm.weight"),
        place + "post_attention_layernorm": state.pop(p + "post_attention_layernorm.weight"),
        place + "qkv_proj": fuse_rows([state.pop(f"{attn}{n}_proj.weight") for n in "qkv"]),
        place + "qkv_bias": torch.cat([as_float(state.pop(f"{attn}{n}_proj.bias"))
                                       for n in "qkv"]),
        place + "o_proj": state.pop(attn + "o_proj.weight"),
        place + "o_bias": state.pop(attn + "o_proj.bias"),
        place + "sinks": state.pop(attn + "sinks"),
        place + "moe.gate": state.pop(p + "mlp.router.weight"),
        place + "moe.router_bias": state.pop(p + "mlp.router.bias"),
    }
    experts = p + "mlp.experts."
    if experts + "gate_up_proj_blocks" in state:
        out.update(_mxfp4_experts(state, experts, place))
    elif experts + "gate_up_proj" in state:
        out.update(_stacked_experts(state, experts, place))
    else:
        out.update(_gguf_experts(state, experts, place, arch))
    return out


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """[2I, ...] rows gate, up, gate, up, ... -> [gate rows; up rows]."""
    return torch.cat([rows[0::2], rows[1::2]])


def _stacked_experts(state: dict[str, Any], experts: str, place: str) -> dict[str, Any]:
    gate_up = state.pop(experts + "gate_up_proj")  # [E, hidden, 2I]
    down = state.pop(experts + "down_proj")  # [E, I, hidden]
    out: dict[str, Any] = {
        place + "moe.gate_up_bias": torch.stack([_deinterleave(b) for b in
                                                 state.pop(experts + "gate_up_proj_bias")]),
        place + "moe.down_bias": state.pop(experts + "down_proj_bias"),
    }
    for e in range(gate_up.shape[0]):
        out[f"{place}moe.experts.{e}.gate_up_proj"] = _deinterleave(gate_up[e].t()).contiguous()
        out[f"{place}moe.experts.{e}.down_proj"] = down[e].t().contiguous()
    return out


def _mxfp4_experts(state: dict[str, Any], experts: str, place: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        place + "moe.gate_up_bias": torch.stack([_deinterleave(b) for b in
                                                 state.pop(experts + "gate_up_proj_bias")]),
        place + "moe.down_bias": state.pop(experts + "down_proj_bias"),
    }
    for part in ("gate_up_proj", "down_proj"):
        blocks = state.pop(f"{experts}{part}_blocks")  # [E, rows, K/32, 16]
        scales = state.pop(f"{experts}{part}_scales")  # [E, rows, K/32]
        raw = hf_mxfp4_to_gguf_blocks(blocks, scales)  # [E, rows, K/32 * 17]
        num_rows, in_features = blocks.shape[1], blocks.shape[2] * 32
        for e in range(blocks.shape[0]):
            rows = _deinterleave(raw[e]) if part == "gate_up_proj" else raw[e]
            out[f"{place}moe.experts.{e}.{part}"] = RawBlocks(rows.contiguous(), GGML_MXFP4,
                                                              (num_rows, in_features))
    return out


def _gguf_experts(state: dict[str, Any], experts: str, place: str,
                  arch: ArchConfig) -> dict[str, Any]:
    assert arch.gpt_oss is not None
    out: dict[str, Any] = {
        place + "moe.gate_up_bias": torch.cat([as_float(state.pop(experts + "gate_proj.bias")),
                                               as_float(state.pop(experts + "up_proj.bias"))],
                                              dim=1),
        place + "moe.down_bias": state.pop(experts + "down_proj.bias"),
    }
    for e in range(arch.gpt_oss.num_experts):
        out[f"{place}moe.experts.{e}.gate_up_proj"] = fuse_rows(
            [state.pop(f"{experts}{e}.{part}_proj.weight") for part in ("gate", "up")])
        out[f"{place}moe.experts.{e}.down_proj"] = state.pop(f"{experts}{e}.down_proj.weight")
    return out

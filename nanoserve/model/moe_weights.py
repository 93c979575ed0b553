"""A MoE layer's weights, from either source, into moe.py's `MoeBlock` (weights.py calls these).

Hugging Face checkpoints of Qwen2-MoE and Qwen3-MoE (and what transformers' save_pretrained
writes) hold one 2-D tensor per expert, `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`;
GGUF files stack them as 3-D tensors `blk.N.ffn_{gate,up,down}_exps.weight` [E, rows, columns]
(PyTorch's order). The GGUF reader splits each stacked tensor into the per-expert names, as
views of the mapped file, so that both sources meet in one dict, every expert's weight is a
matmul weight of its own (quantized blocks as the file stores them: each expert's rows are whole
rows of blocks), and tensor parallelism cuts each expert's rows and columns by the same name
rules as the dense MLP's (shard.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.moe_arch import MoeConfig
from nanoserve.model.quantization import RawBlocks, as_float, fuse_rows

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`); the
# stacked `*_exps` tensors get the expert's index after `experts.` when they are split
GGUF_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}

Loaded = torch.Tensor | RawBlocks | list[RawBlocks]


def split_gguf_experts(gguf: GGUFFile, name: str, hf_name: str, keep_blocks: bool
                       ) -> Iterator[tuple[str, torch.Tensor | RawBlocks]]:
    """The 3-D GGUF tensor `name` (`hf_name` once mapped) as one 2-D weight per expert, under
    the per-expert Hugging Face names: raw blocks (views of the mapped file) with
    `keep_blocks` where the kernel reads the type, else float32."""
    tensor = gguf.tensors[name]
    num_experts, num_rows, in_features = tensor.shape
    prefix, _, rest = hf_name.partition("experts.")
    names = [f"{prefix}experts.{e}.{rest}" for e in range(num_experts)]
    blocks = RawBlocks(tensor.data, tensor.ggml_type, (num_rows, in_features))
    if keep_blocks and blocks.has_kernel:
        per_expert = tensor.data.reshape(num_experts, -1)
        for e, expert_name in enumerate(names):
            yield expert_name, RawBlocks(per_expert[e], tensor.ggml_type, (num_rows, in_features))
        return
    values = gguf.dequantize(name)  # [E, rows, columns]
    for e, expert_name in enumerate(names):
        yield expert_name, values[e]


def pop_moe_weights(state: dict[str, torch.Tensor | RawBlocks], layer_prefix: str, target: str,
                    moe: MoeConfig) -> dict[str, Loaded]:
    """Take one MoE layer's tensors (Hugging Face names under `layer_prefix`,
    `model.layers.N.`) out of `state`, as the model's parameters under `target`
    (`layers.N.moe.`): the router, each expert's gate and up fused, its down, and the shared
    expert's with its gate [1, hidden]. A missing tensor is a KeyError naming it."""
    mlp = layer_prefix + "mlp."
    weights: dict[str, Loaded] = {target + "gate": state.pop(mlp + "gate.weight")}
    experts = [(f"{mlp}experts.{e}.", f"{target}experts.{e}.") for e in range(moe.num_experts)]
    if moe.shared_expert_intermediate_size:
        experts.append((mlp + "shared_expert.", target + "shared_expert."))
        gate = as_float(state.pop(mlp + "shared_expert_gate.weight"))
        weights[target + "shared_expert_gate"] = gate.reshape(1, -1)  # GGUF's is [hidden]
    for source, dest in experts:
        weights[dest + "gate_up_proj"] = fuse_rows([state.pop(source + "gate_proj.weight"),
                                                    state.pop(source + "up_proj.weight")])
        weights[dest + "down_proj"] = state.pop(source + "down_proj.weight")
    return weights

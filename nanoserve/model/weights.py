"""Weights from safetensors directories and GGUF files, named the Hugging Face way, into CausalLM.

Both sources are first turned into one dict keyed by Hugging Face parameter names
(`model.layers.0.self_attn.q_proj.weight`, ...); `load_into` then fuses q/k/v and gate/up.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from nanoserve.model.arch import ArchConfig
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.llama import CausalLM
from nanoserve.model.moe_weights import GGUF_MOE_LAYER_NAMES, pop_moe_weights, split_gguf_experts
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.model.quant_linear import QuantizedWeight
from nanoserve.model.quantization import (
    RawBlocks,
    as_float,
    fuse_rows,
    make_matmul_weight,
    shape_of,
)
from nanoserve.model.shard import column_unit, shard_weight, tensor_split
from nanoserve.model.weight_arena import gather_packed_weights

ReadTensor = torch.Tensor | RawBlocks
Loaded = torch.Tensor | RawBlocks | list[RawBlocks]

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`)
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **GGUF_MOE_LAYER_NAMES,
}
# Gemma 3's four norms a layer: llama.cpp's `ffn_norm` is the one before the MLP, which Gemma
# names pre_feedforward_layernorm (Llama's post_attention_layernorm); the two after
_GGUF_GEMMA3_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def read_safetensors_dir(path: Path, arch: ArchConfig | None = None,
                         group: TensorParallelGroup | None = None, block: int = 1
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a single-file or sharded (`*.safetensors.index.json`) checkpoint; with
    a `group` of several ranks (and the model's `arch`), only this rank's part of each, read
    from the file as a slice (shard.py; columns in whole `block`s for weights quantized at
    load)."""
    from safetensors import safe_open

    is_sharded = group is not None and not group.is_single

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has a config.json but no *.safetensors weights")
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                part = f.get_slice(key)
                shape = tuple(part.get_shape())
                split = (tensor_split(key, shape, arch, group, column_unit(shape, block))
                         if is_sharded and arch is not None and group is not None else None)
                if split is None:
                    yield key, f.get_tensor(key)
                    continue
                dim, start, stop = split
                yield key, (part[start:stop] if dim == 0 else part[:, start:stop]).contiguous()


def read_gguf_tensors(gguf: GGUFFile, arch: ArchConfig, keep_blocks: bool = False,
                      group: TensorParallelGroup | None = None, block: int = 1
                      ) -> Iterator[tuple[str, ReadTensor]]:
    """GGUF tensors under Hugging Face names, with Q/K rows un-permuted for Llama.

    Dequantized to float32, or, with `keep_blocks`, the 2-D weights (projections, embedding,
    head) as the file stores them (`RawBlocks`, still the mapped file until used). With a
    `group` of several ranks, only this rank's part of each (shard.py): raw blocks are sliced
    from the mapped file, so a rank copies only its slices. llama.cpp's converter reorders
    each Llama head's Q and K rows from the HF "rotate halves" layout to interleaved pairs; we
    undo it (on whole rows, so raw blocks too; head by head, so after the rank's heads are
    cut) so the same RoPE code serves both sources. Qwen files are written without it.
    """
    gguf_arch = gguf.metadata.get("general.architecture")
    is_permuted = gguf_arch == "llama"
    for name in gguf.tensors:
        if name == "rope_freqs.weight":
            continue  # read by the loader as RoPE scaling factors
        hf_name = gguf_to_hf_name(name, gguf_arch)
        tensor = gguf.tensors[name]
        if len(tensor.shape) == 3:  # a MoE layer's experts, stacked: a weight per expert
            for expert_name, expert in split_gguf_experts(gguf, name, hf_name, keep_blocks):
                yield expert_name, (expert if group is None
                                    else shard_weight(expert_name, expert, arch, group, block))
            continue
        value: ReadTensor | None = None
        if keep_blocks and len(tensor.shape) == 2:
            blocks = RawBlocks(tensor.data, tensor.ggml_type, (tensor.shape[0], tensor.shape[1]))
            value = blocks if blocks.has_kernel else None
        if value is None:
            value = gguf.dequantize(name)
        if group is not None:
            value = shard_weight(hf_name, value, arch, group, block)
        if is_permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                             "k_proj.bias")):
            rows = value.rows() if isinstance(value, RawBlocks) else value
            rows = unpermute_rope_rows(rows, rows.shape[0] // arch.head_dim)
            value = replace(value, data=rows) if isinstance(value, RawBlocks) else rows
        yield hf_name, value


def gemma_norms_as_weights(tensors: Iterator[tuple[str, ReadTensor]]
                           ) -> Iterator[tuple[str, ReadTensor]]:
    """Gemma's checkpoints store each RMSNorm's weight w and multiply by 1 + w (in float32);
    the layers here multiply by the weight, so it becomes 1 + w (llama.cpp's converter does the
    same, so a GGUF file holds 1 + w already)."""
    for name, value in tensors:
        if name.endswith("norm.weight") and isinstance(value, torch.Tensor):
            value = 1.0 + value.float()
        yield name, value


def gguf_to_hf_name(name: str, gguf_arch: str | None = None) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    names = {**_GGUF_LAYER_NAMES, **_GGUF_GEMMA3_NAMES} if gguf_arch == "gemma3" \
        else _GGUF_LAYER_NAMES
    parts = name.split(".")
    if parts[0] != "blk" or parts[2] not in names:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: per head, rows (2, D/2) interleaved -> (D/2, 2)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def load_into(model: CausalLM, tensors: Iterator[tuple[str, ReadTensor]], dtype: torch.dtype,
              device: torch.device, quantization: str = "none") -> None:
    """Copy HF-named tensors into the model, fusing q/k/v and gate/up; check nothing is missing.

    Matmul weights become what `quantization` (resolved, see quantization.py) asks for.
    Under tensor parallelism the readers give this rank's part of each tensor (cut as they
    read, by the model's group), fused here after the cut (mini-sglang's order: shard, then
    merge); the shapes are checked against this rank's model."""
    arch = model.arch
    state = {name: t for name, t in tensors}
    fused: dict[str, Loaded] = {
        "embed_tokens": state.pop("model.embed_tokens.weight"),
        "norm": state.pop("model.norm.weight"),
    }
    head = state.pop("lm_head.weight", None)
    if head is not None and not arch.tie_word_embeddings:
        fused["lm_head"] = head
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        fused[f"layers.{i}.input_layernorm"] = state.pop(p + "input_layernorm.weight")
        if arch.has_sandwich_norms:  # Gemma: a norm before and after the attention and the MLP
            fused[f"layers.{i}.attn_output_norm"] = state.pop(
                p + "post_attention_layernorm.weight")
            fused[f"layers.{i}.post_attention_layernorm"] = state.pop(
                p + "pre_feedforward_layernorm.weight")
            fused[f"layers.{i}.mlp_output_norm"] = state.pop(
                p + "post_feedforward_layernorm.weight")
        else:
            fused[f"layers.{i}.post_attention_layernorm"] = state.pop(
                p + "post_attention_layernorm.weight")
        fused[f"layers.{i}.qkv_proj"] = fuse_rows(
            [state.pop(f"{attn}{n}_proj.weight") for n in "qkv"])
        if arch.has_qkv_bias:
            fused[f"layers.{i}.qkv_bias"] = torch.cat(
                [as_float(state.pop(f"{attn}{n}_proj.bias")) for n in "qkv"])
        fused[f"layers.{i}.o_proj"] = state.pop(attn + "o_proj.weight")
        if arch.has_qk_norm:
            fused[f"layers.{i}.q_norm"] = state.pop(attn + "q_norm.weight")
            fused[f"layers.{i}.k_norm"] = state.pop(attn + "k_norm.weight")
        if arch.moe is not None and arch.moe.is_sparse(i):  # its router and experts instead
            fused.update(pop_moe_weights(state, p, f"layers.{i}.moe.", arch.moe))
            continue
        fused[f"layers.{i}.gate_up_proj"] = fuse_rows(
            [state.pop(p + "mlp.gate_proj.weight"), state.pop(p + "mlp.up_proj.weight")])
        fused[f"layers.{i}.down_proj"] = state.pop(p + "mlp.down_proj.weight")
    leftover = [k for k in state if "rotary_emb" not in k]
    if leftover:
        raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}")

    expected = dict(model.named_parameters())
    if arch.tie_word_embeddings:
        expected.pop("lm_head", None)
    missing = sorted(set(expected) - set(fused))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
    for name, value in fused.items():
        want = tuple(expected[name].shape)
        if shape_of(value) != want:
            raise ValueError(f"weight {name}: checkpoint shape {shape_of(value)}, "
                             f"model expects {want}")
        if name.endswith(_MATMUL_WEIGHTS):
            _set_weight(model, name, make_matmul_weight(value, quantization, dtype, device))
        elif name == "embed_tokens" and isinstance(value, RawBlocks) and quantization == "gguf":
            # looked up row by row (exact); the tied head multiplies with the same blocks
            _set_weight(model, name, QuantizedWeight.from_gguf(value.rows(), value.ggml_type,
                                                               value.shape))
        else:
            _set_weight(model, name, as_float(value).to(device=device, dtype=dtype).contiguous())
    if arch.tie_word_embeddings:  # the head multiplies with the embedding's own blocks, or a
        embedding = model.embed_tokens  # packed float copy (the embedding stays plain)
        _set_weight(model, "lm_head", embedding if isinstance(embedding, QuantizedWeight)
                    else make_matmul_weight(embedding.data, quantization, dtype, device))
    _keep_wide_forms(model)
    if device.type == "cpu":
        gather_packed_weights(model)  # one huge-page buffer, in the order a step reads them


# The 4- and 5-bit weights' wide forms (quant_linear.py) are kept when all of them together
# take at most this much more memory: a model up to ~2B parameters (+0.5 byte per weight).
WIDE_FORMS_BUDGET = 1 << 30


def _keep_wide_forms(model: torch.nn.Module) -> None:
    """Give every 4- and 5-bit matmul weight its wide form, if they all fit WIDE_FORMS_BUDGET. The
    embedding is looked up row by row, never multiplied (a tied head is `lm_head` too)."""
    targets = [(f"{name}.{attr}", weight) for name, layer in model.named_modules()
               for attr, weight in vars(layer).items()
               if attr != "embed_tokens" and isinstance(weight, QuantizedWeight)
               and weight.can_widen]
    extra = sum(weight.wide_extra_bytes for _, weight in targets)
    if extra > WIDE_FORMS_BUDGET:
        return
    for dotted_name, weight in targets:
        _set_weight(model, dotted_name.lstrip("."), weight.widened())


_MATMUL_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def _set_weight(model: torch.nn.Module, dotted_name: str, value: object) -> None:
    """Replace a (meta-device) parameter with real data, without an init pass or a copy. A
    tensor stays a Parameter; a quantized weight becomes a plain attribute."""
    owner_name, _, attr = dotted_name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if isinstance(value, torch.Tensor):
        setattr(owner, attr, torch.nn.Parameter(value, requires_grad=False))
        return
    owner._parameters.pop(attr, None)
    setattr(owner, attr, value)


def gguf_rope_factors(gguf: GGUFFile) -> torch.Tensor | None:
    if "rope_freqs.weight" not in gguf.tensors:
        return None
    return gguf.dequantize("rope_freqs.weight")

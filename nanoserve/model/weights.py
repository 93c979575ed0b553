"""Weights from safetensors directories and GGUF files, named the Hugging Face way, into CausalLM.

Both sources are first turned into one dict keyed by Hugging Face parameter names
(`model.layers.0.self_attn.q_proj.weight`, ...); `load_into` then fuses q/k/v and gate/up.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from nanoserve.model.arch import ArchConfig
from nanoserve.model.gemma4_loading import MODEL_PLACES as GEMMA4_MODEL_PLACES
from nanoserve.model.gemma4_loading import pop_gemma4_layer
from nanoserve.model.gemma4_weights import gemma4_hf_name
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.gpt_oss_loading import gpt_oss_hf_name, pop_gpt_oss_layer
from nanoserve.model.hybrid_weights import pop_delta_net, reorder_heads, split_gated_query
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
from nanoserve.model.weight_arena import HeapTrim, gather_packed_weights

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
# Qwen3.5's (`qwen35`, `qwen35moe`): the Gated DeltaNet mixer's tensors and the norm after the
# mixer, as llama.cpp's converter names them (conversion/qwen.py, Qwen3NextModel and
# _LinearAttentionVReorderBase; gguf-py's tensor map). Value heads stay in its tiled order
# (linear_arch.py): in_proj_qkv's v rows, in_proj_z's, in_proj_a/b's rows, the conv's v
# channels, out_proj's columns, ssm_a and dt_bias. The full-attention layers keep attn_q/k/v:
# q_proj's rows hold each head's query then its gate, as in Hugging Face's (qwen35.cpp views
# them so).
_GGUF_QWEN35_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_conv1d": "linear_attn.conv1d",  # float [conv_dim, kernel]: HF's [conv_dim, 1, kernel]
    "ssm_norm": "linear_attn.norm",  # the gated norm's w itself (no 1 + w)
}
# ... and the two named apart from a module: `ssm_a` (no suffix) holds -exp(A_log), computed by
# the converter; `ssm_dt.bias` is HF's dt_bias
_GGUF_QWEN35_TENSORS = {"ssm_a": "linear_attn.neg_exp_a", "ssm_dt.bias": "linear_attn.dt_bias"}
_GGUF_ARCH_LAYER_NAMES = {
    "gemma3": {**_GGUF_LAYER_NAMES, **_GGUF_GEMMA3_NAMES},
    "qwen35": {**_GGUF_LAYER_NAMES, **_GGUF_QWEN35_NAMES},
    "qwen35moe": {**_GGUF_LAYER_NAMES, **_GGUF_QWEN35_NAMES},
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
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                key = text_weight_name(stored)
                if key is None:  # a vision tower's (model/vision/ reads those)
                    continue
                part = f.get_slice(stored)
                shape = tuple(part.get_shape())
                split = (tensor_split(key, shape, arch, group, column_unit(shape, block))
                         if is_sharded and arch is not None and group is not None else None)
                if split is None:
                    yield key, f.get_tensor(stored)
                    continue
                dim, start, stop = split
                yield key, (part[start:stop] if dim == 0 else part[:, start:stop]).contiguous()


# a multimodal checkpoint's text half, under the names a text-only one uses
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "visual.", "model.vision_tower.",
                    "model.multi_modal_projector.", "model.visual.")


def text_weight_name(key: str) -> str | None:
    """A checkpoint tensor's name in the text model (Gemma3ForConditionalGeneration writes
    `language_model.model.*` or `model.language_model.*`), or None for a vision tower's."""
    if key.startswith(_VISION_PREFIXES):
        return None
    for prefix, replacement in _TEXT_PREFIXES:
        if key.startswith(prefix):
            return replacement + key[len(prefix):]
    return key


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
        if _is_mtp_block(name, arch):
            continue  # a multi-token-prediction head (Qwen3.5's `nextn`), not run here
        mapped = (gemma4_hf_name(name) if gguf_arch == "gemma4"
                  else gpt_oss_hf_name(name) if gguf_arch == "gpt-oss"
                  else gguf_to_hf_name(name, gguf_arch))
        if mapped is None:
            continue
        hf_name = mapped
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


def offset_norms_as_weights(tensors: Iterator[tuple[str, ReadTensor]]
                           ) -> Iterator[tuple[str, ReadTensor]]:
    """Gemma's and Qwen3.5's checkpoints store each RMSNorm's weight w and multiply by 1 + w
    (in float32); the layers here multiply by the weight, so it becomes 1 + w (llama.cpp's
    converter does the same, so a GGUF file holds 1 + w already). A DeltaNet layer's gated
    norm (`linear_attn.norm`) multiplies by its weight itself."""
    for name, value in tensors:
        if (name.endswith("norm.weight") and isinstance(value, torch.Tensor)
                and not name.endswith("linear_attn.norm.weight")):
            value = 1.0 + value.float()
        yield name, value


def gguf_to_hf_name(name: str, gguf_arch: str | None = None) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    names = _GGUF_ARCH_LAYER_NAMES.get(gguf_arch or "", _GGUF_LAYER_NAMES)
    parts = name.split(".", 2)  # blk, N, the rest
    if parts[0] == "blk" and len(parts) == 3:
        if gguf_arch in ("qwen35", "qwen35moe") and parts[2] in _GGUF_QWEN35_TENSORS:
            return f"model.layers.{parts[1]}.{_GGUF_QWEN35_TENSORS[parts[2]]}"
        module, _, suffix = parts[2].partition(".")
        if module in names and suffix:
            return f"model.layers.{parts[1]}.{names[module]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _is_mtp_block(name: str, arch: ArchConfig) -> bool:
    """A tensor of a block after the decoder layers: a file's MTP head (llama.cpp's
    `nextn_predict_layers` blocks, `blk.{num_layers}.*` on)."""
    parts = name.split(".", 2)
    return parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= arch.num_layers


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
    for name, place in GEMMA4_MODEL_PLACES.items():  # Gemma 4's per-layer embedding parts
        if name in state:
            fused[place] = state.pop(name)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        if arch.gemma4 is not None:  # its own layer (gemma4_loading.py)
            fused.update(pop_gemma4_layer(state, arch, i))
            continue
        if arch.gpt_oss is not None:  # its own layer (gpt_oss_loading.py)
            fused.update(pop_gpt_oss_layer(state, arch, i))
            continue
        fused[f"layers.{i}.input_layernorm"] = state.pop(p + "input_layernorm.weight")
        if arch.is_linear(i):  # a hybrid's Gated DeltaNet layer (hybrid_weights.py)
            fused.update(pop_delta_net(state, p, f"layers.{i}.", arch))
            fused[f"layers.{i}.post_attention_layernorm"] = state.pop(
                p + "post_attention_layernorm.weight")
        else:
            _pop_attention(state, fused, arch, i)
        if arch.moe is not None and arch.moe.is_sparse(i):  # its router and experts instead
            fused.update(pop_moe_weights(state, p, f"layers.{i}.moe.", arch.moe))
            continue
        fused[f"layers.{i}.gate_up_proj"] = fuse_rows(
            [state.pop(p + "mlp.gate_proj.weight"), state.pop(p + "mlp.up_proj.weight")])
        fused[f"layers.{i}.down_proj"] = state.pop(p + "mlp.down_proj.weight")
    leftover = [k for k in state if "rotary_emb" not in k]
    if leftover:
        raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}")
    _set_weights(model, fused, dtype, device, quantization)


def _pop_attention(state: dict[str, ReadTensor], fused: dict[str, Loaded], arch: ArchConfig,
                   i: int) -> None:
    """Layer i's attention weights and the norm after it, fused (q/k/v into one)."""
    p = f"model.layers.{i}."
    attn = p + "self_attn."
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
    q, k, v = (state.pop(f"{attn}{n}_proj.weight") for n in "qkv")
    q_norm = state.pop(attn + "q_norm.weight") if arch.has_qk_norm else None
    k_norm = state.pop(attn + "k_norm.weight") if arch.has_qk_norm else None
    if arch.has_attn_output_gate:  # Qwen3.5: the gate's rows sit in q_proj's
        q, fused[f"layers.{i}.attn_gate_proj"] = split_gated_query(q, arch)
    if arch.rotary_dim < arch.head_dim:  # partial rotary as full (hybrid_weights.py)
        q, k = reorder_heads(q, arch, arch.num_heads), reorder_heads(k, arch,
                                                                    arch.num_kv_heads)
        q_norm = None if q_norm is None else reorder_heads(q_norm, arch, 1)
        k_norm = None if k_norm is None else reorder_heads(k_norm, arch, 1)
    fused[f"layers.{i}.qkv_proj"] = fuse_rows([q, k, v])
    if arch.has_qkv_bias:
        fused[f"layers.{i}.qkv_bias"] = torch.cat(
            [as_float(state.pop(f"{attn}{n}_proj.bias")) for n in "qkv"])
    fused[f"layers.{i}.o_proj"] = state.pop(attn + "o_proj.weight")
    if q_norm is not None and k_norm is not None:
        fused[f"layers.{i}.q_norm"], fused[f"layers.{i}.k_norm"] = q_norm, k_norm


def _set_weights(model: CausalLM, fused: dict[str, Loaded], dtype: torch.dtype,
                 device: torch.device, quantization: str) -> None:
    """Put the fused weights into the model, each checked against its place's shape."""
    arch = model.arch
    expected = dict(model.named_parameters())
    if arch.tie_word_embeddings:
        expected.pop("lm_head", None)
    missing = sorted(set(expected) - set(fused))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
    trim = HeapTrim()  # (weight_arena.py: the heap's holes given back as the load goes)
    for name in list(fused):  # each popped once placed: a raw copy is freed once packed
        value = fused.pop(name)
        want = tuple(expected[name].shape)
        trim.after(math.prod(want))
        if shape_of(value) != want:
            raise ValueError(f"weight {name}: checkpoint shape {shape_of(value)}, "
                             f"model expects {want}")
        if name.endswith(_MATMUL_WEIGHTS):
            _set_weight(model, name, make_matmul_weight(value, quantization, dtype, device))
        elif (name in ("embed_tokens", "embed_tokens_per_layer") and isinstance(value, RawBlocks)
              and quantization == "gguf"):
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
               if attr not in ("embed_tokens", "embed_tokens_per_layer")
               and isinstance(weight, QuantizedWeight)
               and weight.can_widen]
    extra = sum(weight.wide_extra_bytes for _, weight in targets)
    if extra > WIDE_FORMS_BUDGET:
        return
    for dotted_name, weight in targets:
        _set_weight(model, dotted_name.lstrip("."), weight.widened())


_MATMUL_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head",
                   "attn_gate_proj", "in_proj", "ba_proj", "out_proj", "ple_gate", "ple_proj",
                   "per_layer_model_projection")


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

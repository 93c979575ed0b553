"""What every test that writes a tiny checkpoint as GGUF (the way llama.cpp's converter does)
shares: the shape keys read from the transformers config, and the file's writing; and the
Qwen3.5 writer (`write_qwen35_gguf`), whose conventions nanoserve's GGUF reader undoes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch


def add_shape(writer: gguf.GGUFWriter, cfg: Any, rope_theta: float,
              head_dim: int | None = None) -> None:
    """Layers, context, widths, heads, RoPE base, norm epsilon and vocabulary from `cfg`;
    `head_dim` where the file states it (an architecture whose heads are not hidden / heads)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def tensor_name(hf_name: str, short_names: dict[str, str]) -> tuple[str, str | None]:
    """A transformers tensor's GGUF name, and for a layer's tensor its module ("self_attn.q_proj")
    that `short_names` maps to llama.cpp's short name ("attn_q"); None for the others."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight", None
    if hf_name == "model.norm.weight":
        return "output_norm.weight", None
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{short_names[module]}.weight", module


def mmproj_writer(path: Path, *, projection_dim: int, image_size: int, patch_size: int,
                  hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int,
                  image_mean: Any, image_std: Any) -> gguf.GGUFWriter:
    """A writer of llama.cpp's mmproj GGUF (`general.architecture` "clip", F16 matrices) with
    the vision tower's keys every projector type carries; the caller adds its own."""
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(projection_dim)
    writer.add_vision_image_size(image_size)
    writer.add_vision_patch_size(patch_size)
    writer.add_vision_embedding_length(hidden_size)
    writer.add_vision_feed_forward_length(intermediate_size)
    writer.add_vision_block_count(num_layers)
    writer.add_vision_head_count(num_heads)
    writer.add_vision_image_mean(image_mean)
    writer.add_vision_image_std(image_std)
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    """Header, metadata and tensors to the file, then close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# -- Gemma 3 (`gemma3`), as llama.cpp's converter writes it: norms as 1 + w, q and k rows as
# they are (no permute), the head tied to the embedding
_GEMMA3_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}


def add_gemma3_tensors(writer: gguf.GGUFWriter, state: dict[str, torch.Tensor],
                       qtype_of: Any = None) -> None:
    """A Gemma 3 text model's tensors (transformers' names, `model.layers.N...`) into
    `writer`; `qtype_of(gguf_name)` the block type of each 2-D weight (None: float32)."""
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue  # tied
        w = tensor.float().numpy()
        if name.endswith("norm.weight"):
            w = w + 1.0
        gguf_name, _ = tensor_name(name, _GEMMA3_NAMES)
        qtype = qtype_of(gguf_name) if qtype_of is not None and w.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(gguf_name, w)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


# -- Qwen3.5 (`qwen35` / `qwen35moe`), as llama.cpp's converter writes it -------------------------
# (conversion/qwen.py: Qwen3_5TextModel / Qwen3_5MoeTextModel over _LinearAttentionVReorderBase,
# Qwen3NextModel, _QwenMtpMixin and Qwen2MoeModel; tensor names from gguf-py's tensor map)
# GGUF names that the converter keeps in float32 whatever the file's type (base.py's
# prepare_tensors: routers, the conv, 1-D tensors and norms)
_F32_ONLY = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def write_qwen35_gguf(hf_model_or_state_dict: Any, config: Any, path: Path | str, *,
                      moe: bool | None = None, qtype: Any = gguf.GGMLQuantizationType.F32,
                      num_mtp_layers: int = 0, seed: int = 0) -> Path:
    """A transformers Qwen3.5 text model (`Qwen3_5ForCausalLM`, or `Qwen3_5MoeForCausalLM`
    with `moe`, None: from the config) as the GGUF llama.cpp's converter writes: its names, its
    transforms (value heads grouped -> tiled where key heads != value heads, A_log -> -exp,
    dt_bias -> ssm_dt.bias, the conv squeezed to [C, K], every norm but the DeltaNet's as
    1 + w, stacked experts) and its metadata, with the default model's tokenizer padded to the
    vocabulary. Matmul weights (2-D and stacked experts, embedding and head too) in `qtype`,
    the rest F32. `num_mtp_layers` appends random multi-token-prediction blocks after the
    decoder layers (transformers drops the checkpoint's `mtp.*`; a converted file holds them)."""
    from nanoserve.bench.random_gguf import add_default_tokenizer
    from nanoserve.bench.random_qwen35_gguf import add_qwen35_metadata
    from nanoserve.model.gguf_file import GGUFFile
    from nanoserve.model.loader import default_model_path

    state = hf_model_or_state_dict if isinstance(hf_model_or_state_dict, dict) \
        else hf_model_or_state_dict.state_dict()
    is_moe = bool(getattr(config, "num_experts", 0)) if moe is None else moe
    arch = gguf.MODEL_ARCH.QWEN35MOE if is_moe else gguf.MODEL_ARCH.QWEN35
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    add_qwen35_metadata(writer, config.to_dict(), num_mtp_layers)
    add_default_tokenizer(writer, GGUFFile(default_model_path()).metadata,
                          vocab_size=config.vocab_size)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors: dict[str, np.ndarray] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # save_pretrained leaves a tied head out; so does the file
        for hf_name, value in _qwen35_converted(name, tensor.detach().float(), config):
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise KeyError(f"no GGUF name for {hf_name!r}")
            tensors[gguf_name] = value.contiguous().numpy()
    tensors.update(_mtp_blocks(tensors, config, num_mtp_layers, seed))
    for gguf_name, array in tensors.items():
        is_f32 = (array.ndim <= 1 or gguf_name.endswith(("_norm.weight", *_F32_ONLY))
                  or not gguf_name.endswith(".weight"))
        if is_f32 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    finish(writer)
    return Path(path)


def _tile_v_heads(tensor: torch.Tensor, dim: int, num_k_heads: int, num_v_heads: int,
                 head_dim: int) -> torch.Tensor:
    """Value heads grouped by key head -> tiled, along `dim` (_reorder_v_heads)."""
    shape = list(tensor.shape)
    dim %= len(shape)
    per_k = num_v_heads // num_k_heads
    split = tensor.reshape(*shape[:dim], num_k_heads, per_k, head_dim, *shape[dim + 1:])
    return split.transpose(dim, dim + 1).reshape(shape)


def _qwen35_converted(name: str, value: torch.Tensor, cfg: Any
                      ) -> list[tuple[str, torch.Tensor]]:
    """One transformers tensor as the converter's (Hugging Face-named) tensors, in its order:
    value heads tiled, then Qwen3NextModel's transforms, then the experts stacked."""
    if "linear_attn." in name:
        value = _tiled_linear_attn(name, value, cfg)
    if name.endswith(".A_log"):
        value = -torch.exp(value)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        value = value.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = value + 1
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 I, H] -> gate, up [E, I, H]
        gate, up = value.chunk(2, dim=-2)
        base = name.removesuffix(".gate_up_proj")
        return [(f"{base}.gate_proj.weight", gate), (f"{base}.up_proj.weight", up)]
    if name.endswith("mlp.experts.down_proj"):
        return [(f"{name}.weight", value)]
    return [(name, value)]


def _tiled_linear_attn(name: str, value: torch.Tensor, cfg: Any) -> torch.Tensor:
    """_LinearAttentionVReorderBase.modify_tensors: a DeltaNet tensor's value heads tiled."""
    num_k, num_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if num_k == num_v:
        return value
    head_v = cfg.linear_value_head_dim
    qk = 2 * num_k * cfg.linear_key_head_dim  # q and k rows (channels) before v's
    if ".in_proj_qkv." in name:
        return torch.cat([value[:qk], _tile_v_heads(value[qk:], 0, num_k, num_v, head_v)])
    if ".in_proj_z." in name:
        return _tile_v_heads(value, 0, num_k, num_v, head_v)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
        return _tile_v_heads(value, 0, num_k, num_v, 1)
    if ".conv1d" in name:
        value = value.squeeze()
        return torch.cat([value[:qk], _tile_v_heads(value[qk:], 0, num_k, num_v, head_v)])
    if ".out_proj." in name:
        return _tile_v_heads(value, 1, num_k, num_v, head_v)
    return value  # the gated norm's weight: one value head's


def _mtp_blocks(tensors: dict[str, np.ndarray], cfg: Any, num_mtp_layers: int, seed: int
                ) -> dict[str, np.ndarray]:
    """Random MTP blocks where the converter puts them (block `num_hidden_layers` on): a full
    attention layer's tensors (the last one's shapes) and the `nextn` ones."""
    rng = np.random.default_rng(seed)
    last = max(i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention")
    hidden = cfg.hidden_size
    blocks: dict[str, np.ndarray] = {}
    for block in range(cfg.num_hidden_layers, cfg.num_hidden_layers + num_mtp_layers):
        for name, value in tensors.items():
            if name.startswith(f"blk.{last}."):
                rest = name.removeprefix(f"blk.{last}.")
                blocks[f"blk.{block}.{rest}"] = rng.standard_normal(
                    value.shape, dtype=np.float32) * 0.02
        blocks[f"blk.{block}.nextn.eh_proj.weight"] = rng.standard_normal(
            (hidden, 2 * hidden), dtype=np.float32) * 0.02
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            blocks[f"blk.{block}.nextn.{norm}.weight"] = np.ones(hidden, dtype=np.float32)
    return blocks

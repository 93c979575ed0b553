"""Gemma 3's vision tower from a Hugging Face directory or a llama.cpp mmproj GGUF.

Both sources are read into one dict under SigLIP's short names
(`encoder.layers.0.self_attn.q_proj.weight`, `post_layernorm.bias`, ...) plus the projector's
`mm_input_projection_weight` [vision_hidden, text_hidden] and `mm_soft_emb_norm.scale`, the
1 + w that Gemma's RMSNorm multiplies by (llama.cpp's converter stores 1 + w; a Hugging Face
checkpoint stores w). Only the vision tensors are read: a checkpoint's text weights stay
on disk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.vision.qwen35_vit import Qwen35VisionTower
from nanoserve.model.vision.qwen35_weights import load_qwen35_vision
from nanoserve.model.vision.siglip import (
    EncoderLayerWeights,
    Gemma3VisionTower,
    SiglipArch,
    TowerWeights,
)
from nanoserve.model.vision.tensor_checks import checked_tensor
from nanoserve.model.vision.tower_matmul import attention_dtype, tower_form, tower_matmul

# transformers' defaults for what a config.json saved with `use_diff` leaves out
# (SiglipVisionConfig, Gemma3TextConfig.hidden_size, Gemma3Config.mm_tokens_per_image)
_SIGLIP_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "layer_norm_eps": 1e-6,
    "hidden_act": "gelu_pytorch_tanh",
}
_DEFAULT_TEXT_HIDDEN_SIZE = 2304
_DEFAULT_TOKENS_PER_IMAGE = 256
_DEFAULT_SCALE_FACTOR = 4  # llama.cpp's gemma3 pooling factor when the mmproj states none
NORM_SCALE = "mm_soft_emb_norm.scale"

# mmproj GGUF names (llama.cpp tools/mtmd/clip-impl.h; gguf's MODEL_ARCH.MMPROJ tensor map)
_GGUF_NAMES = {
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
}


def load_vision_tower(path: Path, mmproj: Path | None, dtype: torch.dtype,
                      device: torch.device, quantization: str = "none"
                      ) -> Gemma3VisionTower | Qwen35VisionTower | None:
    """The vision tower of the model at `path` (a Hugging Face directory, or a text GGUF file,
    which holds none) or of `mmproj` (llama.cpp's mmproj GGUF), which wins when given; None
    where there is no tower this module builds (a text-only model). Weights in `dtype` on
    `device`, the matmul weights in the form the text model's resolved `quantization` mode
    gives (`tower_matmul.tower_form`); a missing or misshapen tensor is a ValueError naming
    the file and tensor. Qwen3.5's tower is built by `qwen35_weights.py`."""
    qwen35 = load_qwen35_vision(path, mmproj, dtype, device, quantization)
    if qwen35 is not None:
        return qwen35
    form = tower_form(quantization, device)
    if mmproj is not None:
        gguf = GGUFFile(mmproj)
        arch = mmproj_arch(gguf.metadata, mmproj)
        tensors = dict(_read_mmproj(gguf))
        source = str(mmproj)
    elif path.is_dir():
        hf_arch = vision_arch_of(json.loads((path / "config.json").read_text()))
        if hf_arch is None:
            return None
        arch, tensors, source = hf_arch, dict(_read_hf_vision_tensors(path)), str(path)
    else:
        return None
    return Gemma3VisionTower(arch, tower_weights(arch, tensors, source, dtype, device, form),
                             attention_dtype(form, dtype))


def vision_arch_of(config: dict[str, Any]) -> SiglipArch | None:
    """The tower's shape from a Hugging Face config.json (as a dict); None unless it is a
    Gemma 3 (model_type "gemma3") with a vision_config."""
    vision_config = config.get("vision_config")
    if config.get("model_type") != "gemma3" or vision_config is None:
        return None
    vision = {**_SIGLIP_DEFAULTS, **vision_config}
    if vision["hidden_act"] != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 vision_config.hidden_act {vision['hidden_act']!r} is not "
                         "supported; SigLIP's is 'gelu_pytorch_tanh'")
    text = config.get("text_config") or {}
    eps = float(vision["layer_norm_eps"])
    return SiglipArch(
        hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["num_hidden_layers"]),
        num_heads=int(vision["num_attention_heads"]), patch_size=int(vision["patch_size"]),
        image_size=int(vision["image_size"]), layer_norm_eps=eps,
        text_hidden_size=int(text.get("hidden_size", _DEFAULT_TEXT_HIDDEN_SIZE)),
        tokens_per_image=int(config.get("mm_tokens_per_image", _DEFAULT_TOKENS_PER_IMAGE)),
        soft_emb_norm_eps=eps)


def mmproj_arch(metadata: dict[str, Any], path: Path) -> SiglipArch:
    """The tower's shape from an mmproj GGUF's metadata; a ValueError naming `path` unless
    it is llama.cpp's `clip` file with projector type `gemma3`."""
    architecture = metadata.get("general.architecture")
    projector = metadata.get("clip.projector_type", metadata.get("clip.vision.projector_type"))
    if architecture != "clip" or projector != "gemma3":
        raise ValueError(f"{path} is not a Gemma 3 mmproj file (general.architecture "
                         f"{architecture!r}, clip.projector_type {projector!r}); expected "
                         "'clip' and 'gemma3', as llama.cpp's converter writes with --mmproj")
    image_size, patch_size = (int(metadata["clip.vision.image_size"]),
                              int(metadata["clip.vision.patch_size"]))
    scale = int(metadata.get("clip.vision.projector.scale_factor", _DEFAULT_SCALE_FACTOR))
    eps = float(metadata.get("clip.vision.attention.layer_norm_epsilon", 1e-6))
    return SiglipArch(
        hidden_size=int(metadata["clip.vision.embedding_length"]),
        intermediate_size=int(metadata["clip.vision.feed_forward_length"]),
        num_layers=int(metadata["clip.vision.block_count"]),
        num_heads=int(metadata["clip.vision.attention.head_count"]),
        patch_size=patch_size, image_size=image_size, layer_norm_eps=eps,
        text_hidden_size=int(metadata["clip.vision.projection_dim"]),
        tokens_per_image=(image_size // patch_size // scale) ** 2, soft_emb_norm_eps=eps)


def _read_hf_vision_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The vision tower's and projector's tensors of a safetensors checkpoint, under the
    short names; the files that hold only text weights are not opened."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({file for key, file in weight_map.items() if _short_name(key)})
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = _short_name(key)
                if name == "mm_soft_emb_norm.weight":
                    yield NORM_SCALE, f.get_tensor(key).float() + 1  # as Gemma3RMSNorm's 1 + w
                elif name is not None:
                    yield name, f.get_tensor(key)


def _short_name(key: str) -> str | None:
    """A checkpoint key's short name, for both spellings checkpoints use (with or without a
    leading `model.`, with or without `vision_model.` after `vision_tower.`); None for text
    weights and SigLIP's unused pooling head."""
    name = key.removeprefix("model.")
    if name.startswith("multi_modal_projector."):
        return name.removeprefix("multi_modal_projector.")
    if not name.startswith("vision_tower."):
        return None
    name = name.removeprefix("vision_tower.").removeprefix("vision_model.")
    return None if name.startswith("head.") else name


def _read_mmproj(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """An mmproj's tensors as float32, under the short names (other tensors skipped)."""
    for gguf_name in gguf.tensors:
        name = _mmproj_short_name(gguf_name)
        if name is not None:
            yield name, gguf.dequantize(gguf_name)


def _mmproj_short_name(gguf_name: str) -> str | None:
    if gguf_name == "mm.input_projection.weight":
        return "mm_input_projection_weight"
    if gguf_name == "mm.soft_emb_norm.weight":
        return NORM_SCALE  # the converter stored 1 + w
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GGUF_NAMES:
        return f"{_GGUF_NAMES[stem]}.{kind}"
    if stem.startswith("v.blk."):
        layer, _, short = stem.removeprefix("v.blk.").partition(".")
        if short in _GGUF_LAYER_NAMES:
            return f"encoder.layers.{layer}.{_GGUF_LAYER_NAMES[short]}.{kind}"
    return None


def tower_weights(arch: SiglipArch, tensors: dict[str, torch.Tensor], source: str,
                  dtype: torch.dtype, device: torch.device, form: str = "float32"
                  ) -> TowerWeights:
    """`tensors` (short names) checked against `arch`'s shapes and placed on `device` in
    `dtype` (the norm scale in float32); q, k and v fused per layer; the matmul weights in
    `form` (tower_matmul.py), the projector's transposed to [text_hidden, hidden]."""
    hidden, inner = arch.hidden_size, arch.intermediate_size

    def take(name: str, *shape: int, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return checked_tensor(tensors, name, shape, source=source, device=device,
                              dtype=as_dtype, expected="a Gemma 3 checkpoint with its SigLIP "
                              "tower and projector")

    def layer(i: int) -> EncoderLayerWeights:
        prefix = f"encoder.layers.{i}."
        qkv = [f"{prefix}self_attn.{p}_proj" for p in "qkv"]
        return EncoderLayerWeights(
            norm1_weight=take(f"{prefix}layer_norm1.weight", hidden),
            norm1_bias=take(f"{prefix}layer_norm1.bias", hidden),
            qkv_weight=tower_matmul(
                torch.cat([take(f"{n}.weight", hidden, hidden) for n in qkv]), form),
            qkv_bias=torch.cat([take(f"{n}.bias", hidden) for n in qkv]),
            out_weight=tower_matmul(
                take(f"{prefix}self_attn.out_proj.weight", hidden, hidden), form),
            out_bias=take(f"{prefix}self_attn.out_proj.bias", hidden),
            norm2_weight=take(f"{prefix}layer_norm2.weight", hidden),
            norm2_bias=take(f"{prefix}layer_norm2.bias", hidden),
            fc1_weight=tower_matmul(take(f"{prefix}mlp.fc1.weight", inner, hidden), form),
            fc1_bias=take(f"{prefix}mlp.fc1.bias", inner),
            fc2_weight=tower_matmul(take(f"{prefix}mlp.fc2.weight", hidden, inner), form),
            fc2_bias=take(f"{prefix}mlp.fc2.bias", hidden))

    patch = arch.patch_size
    return TowerWeights(
        patch_weight=take("embeddings.patch_embedding.weight", hidden, 3, patch, patch),
        patch_bias=take("embeddings.patch_embedding.bias", hidden),
        position_embedding=take("embeddings.position_embedding.weight",
                                arch.patches_per_side ** 2, hidden),
        layers=tuple(layer(i) for i in range(arch.num_layers)),
        post_norm_weight=take("post_layernorm.weight", hidden),
        post_norm_bias=take("post_layernorm.bias", hidden),
        soft_emb_norm_scale=take(NORM_SCALE, hidden, as_dtype=torch.float32),
        input_projection=tower_matmul(take(
            "mm_input_projection_weight", hidden, arch.text_hidden_size).t().contiguous(), form))

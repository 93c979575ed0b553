"""Qwen3.5's vision tower from a Hugging Face directory or a llama.cpp mmproj GGUF.

Both sources are read into one dict under transformers' names with `visual.` dropped
(`patch_embed.proj.weight` [hidden, 3, 2, p, p], `blocks.0.attn.qkv.weight`,
`merger.linear_fc1.bias`, ...). llama.cpp's converter (conversion/qwen3vl.py) splits the Conv3D
kernel into two Conv2D kernels along time (`v.patch_embd.weight`, `.weight.1`), which are
stacked back, and names the merger `mm.0` / `mm.2` (fc1 / fc2) and `v.post_ln` (its norm).
Only the vision tensors are read: a checkpoint's text weights stay on disk.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.vision.qwen35_vit import (
    Qwen35TowerWeights,
    Qwen35VisionArch,
    Qwen35VisionTower,
    VisionBlockWeights,
)
from nanoserve.model.vision.tensor_checks import checked_tensor
from nanoserve.model.vision.tower_matmul import attention_dtype, tower_form, tower_matmul

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
MMPROJ_PROJECTOR = "qwen3vl_merger"
# transformers' Qwen3_5VisionConfig defaults, for what a config.json saved with `use_diff`
# leaves out; its LayerNorms' eps is fixed at 1e-6 in the modeling code, not in the config
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}
_LAYER_NORM_EPS = 1e-6
_ROPE_THETA = 10000.0  # transformers' default and llama.cpp's fixed value for this tower
_HF_PREFIXES = ("model.visual.", "visual.")
# llama.cpp names -> transformers' (gguf's MMPROJ tensor map, plus the converter's own)
_GGUF_NAMES = {"v.patch_embd": "patch_embed.proj", "v.position_embd": "pos_embed",
               "v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1",
               "mm.2": "merger.linear_fc2"}
_GGUF_BLOCK_NAMES = {"attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ln1": "norm1",
                     "ln2": "norm2", "ffn_up": "mlp.linear_fc1", "ffn_down": "mlp.linear_fc2"}


def load_qwen35_vision(path: Path, mmproj: Path | None, dtype: torch.dtype,
                       device: torch.device, quantization: str = "none"
                       ) -> Qwen35VisionTower | None:
    """Qwen3.5's tower of `mmproj` (llama.cpp's GGUF with projector type qwen3vl_merger),
    which wins when given, or of the Hugging Face directory `path` (config.json model_type
    "qwen3_5"/"qwen3_5_moe" with a vision_config); None where neither is one (another
    model's tower or a text-only model). Weights in `dtype` on `device`, the matmul weights
    in the form the text model's resolved `quantization` mode gives (`tower_matmul.py`); a
    missing or misshapen tensor is a ValueError naming the file and tensor."""
    if mmproj is not None:
        gguf = GGUFFile(mmproj)
        if not is_qwen35_mmproj(gguf.metadata):
            return None
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
    form = tower_form(quantization, device)
    return Qwen35VisionTower(arch, tower_weights(arch, tensors, source, dtype, device, form),
                             attention_dtype(form, dtype))


def is_qwen35_mmproj(metadata: dict[str, Any]) -> bool:
    projector = metadata.get("clip.projector_type", metadata.get("clip.vision.projector_type"))
    return metadata.get("general.architecture") == "clip" and projector == MMPROJ_PROJECTOR


def vision_arch_of(config: dict[str, Any]) -> Qwen35VisionArch | None:
    """The tower's shape from a Hugging Face config.json (as a dict); None unless it is a
    Qwen3.5 with a vision_config."""
    vision_config = config.get("vision_config")
    if config.get("model_type") not in MODEL_TYPES or vision_config is None:
        return None
    vision = {**_VISION_DEFAULTS, **vision_config}
    for key, supported in (("hidden_act", "gelu_pytorch_tanh"), ("temporal_patch_size", 2),
                           ("in_channels", 3)):
        if vision[key] != supported:
            raise ValueError(f"Qwen3.5 vision_config.{key} {vision[key]!r} is not supported; "
                             f"Qwen3.5's is {supported!r}")
    rope = vision.get("rope_parameters") or {}
    return Qwen35VisionArch(
        hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
        num_layers=int(vision["depth"]), num_heads=int(vision["num_heads"]),
        patch_size=int(vision["patch_size"]), merge_size=int(vision["spatial_merge_size"]),
        num_position_embeddings=int(vision["num_position_embeddings"]),
        out_hidden_size=int(vision["out_hidden_size"]), layer_norm_eps=_LAYER_NORM_EPS,
        rope_theta=float(rope.get("rope_theta", _ROPE_THETA)))


def mmproj_arch(metadata: dict[str, Any], path: Path) -> Qwen35VisionArch:
    """The tower's shape from a qwen3vl_merger mmproj's metadata. A ValueError naming `path`
    for a Qwen3-VL file (deepstack layers), whose tower this module does not build."""
    if any(metadata.get("clip.vision.is_deepstack_layers") or ()):
        raise ValueError(f"{path} has deepstack layers (clip.vision.is_deepstack_layers): a "
                         "Qwen3-VL mmproj; only Qwen3.5's and Qwen3.6's vision tower is supported")
    patch_size = int(metadata["clip.vision.patch_size"])
    positions_per_side = int(metadata["clip.vision.image_size"]) // patch_size
    return Qwen35VisionArch(
        hidden_size=int(metadata["clip.vision.embedding_length"]),
        intermediate_size=int(metadata["clip.vision.feed_forward_length"]),
        num_layers=int(metadata["clip.vision.block_count"]),
        num_heads=int(metadata["clip.vision.attention.head_count"]),
        patch_size=patch_size,
        merge_size=int(metadata.get("clip.vision.spatial_merge_size", 2)),
        num_position_embeddings=positions_per_side ** 2,
        out_hidden_size=int(metadata["clip.vision.projection_dim"]),
        layer_norm_eps=float(metadata.get("clip.vision.attention.layer_norm_epsilon",
                                          _LAYER_NORM_EPS)),
        rope_theta=_ROPE_THETA)


def _read_hf_vision_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tower's tensors of a safetensors checkpoint, `visual.` dropped; the files that
    hold only text weights are not opened."""
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
                if name is not None:
                    yield name, f.get_tensor(key)


def _short_name(key: str) -> str | None:
    for prefix in _HF_PREFIXES:
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return None


def _read_mmproj(gguf: GGUFFile) -> Iterator[tuple[str, torch.Tensor]]:
    """An mmproj's tower tensors as float32 under transformers' names, the two temporal
    halves of the patch kernel stacked back into the Conv3D's [hidden, 3, 2, p, p]."""
    halves = [gguf.dequantize(f"v.patch_embd.weight{suffix}") for suffix in ("", ".1")
              if f"v.patch_embd.weight{suffix}" in gguf.tensors]
    if len(halves) == 2:
        yield "patch_embed.proj.weight", torch.stack(halves, dim=2)
    for gguf_name in gguf.tensors:
        stem, _, kind = gguf_name.rpartition(".")
        if stem in _GGUF_NAMES and not gguf_name.startswith("v.patch_embd.weight"):
            yield f"{_GGUF_NAMES[stem]}.{kind}", gguf.dequantize(gguf_name)
        elif stem.startswith("v.blk."):
            block, _, short = stem.removeprefix("v.blk.").partition(".")
            if short in _GGUF_BLOCK_NAMES:
                yield f"blocks.{block}.{_GGUF_BLOCK_NAMES[short]}.{kind}", \
                    gguf.dequantize(gguf_name)


def tower_weights(arch: Qwen35VisionArch, tensors: dict[str, torch.Tensor], source: str,
                  dtype: torch.dtype, device: torch.device, form: str = "float32"
                  ) -> Qwen35TowerWeights:
    """`tensors` (transformers' names, `visual.` dropped) checked against `arch`'s shapes and
    placed on `device` in `dtype`; the Conv3D kernel flattened to [hidden, patch_dim]; the
    matmul weights in `form` (tower_matmul.py)."""
    hidden, inner, merged = arch.hidden_size, arch.intermediate_size, arch.merged_hidden_size

    def take(name: str, *shape: int) -> torch.Tensor:
        return checked_tensor(tensors, name, shape, source=source, device=device, dtype=dtype,
                              expected="a Qwen3.5 checkpoint with its vision tower and merger")

    def block(i: int) -> VisionBlockWeights:
        prefix = f"blocks.{i}."
        return VisionBlockWeights(
            norm1_weight=take(f"{prefix}norm1.weight", hidden),
            norm1_bias=take(f"{prefix}norm1.bias", hidden),
            qkv_weight=tower_matmul(take(f"{prefix}attn.qkv.weight", 3 * hidden, hidden), form),
            qkv_bias=take(f"{prefix}attn.qkv.bias", 3 * hidden),
            out_weight=tower_matmul(take(f"{prefix}attn.proj.weight", hidden, hidden), form),
            out_bias=take(f"{prefix}attn.proj.bias", hidden),
            norm2_weight=take(f"{prefix}norm2.weight", hidden),
            norm2_bias=take(f"{prefix}norm2.bias", hidden),
            fc1_weight=tower_matmul(take(f"{prefix}mlp.linear_fc1.weight", inner, hidden), form),
            fc1_bias=take(f"{prefix}mlp.linear_fc1.bias", inner),
            fc2_weight=tower_matmul(take(f"{prefix}mlp.linear_fc2.weight", hidden, inner), form),
            fc2_bias=take(f"{prefix}mlp.linear_fc2.bias", hidden))

    patch, frames = arch.patch_size, arch.temporal_patch_size
    kernel = take("patch_embed.proj.weight", hidden, arch.in_channels, frames, patch, patch)
    return Qwen35TowerWeights(
        patch_weight=tower_matmul(kernel.reshape(hidden, arch.patch_dim).contiguous(), form),
        patch_bias=take("patch_embed.proj.bias", hidden),
        position_embedding=take("pos_embed.weight", arch.num_position_embeddings, hidden),
        blocks=tuple(block(i) for i in range(arch.num_layers)),
        merger_norm_weight=take("merger.norm.weight", hidden),
        merger_norm_bias=take("merger.norm.bias", hidden),
        merger_fc1_weight=tower_matmul(take("merger.linear_fc1.weight", merged, merged), form),
        merger_fc1_bias=take("merger.linear_fc1.bias", merged),
        merger_fc2_weight=tower_matmul(
            take("merger.linear_fc2.weight", arch.out_hidden_size, merged), form),
        merger_fc2_bias=take("merger.linear_fc2.bias", arch.out_hidden_size))

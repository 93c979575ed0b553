"""A tiny Qwen3.5 with its vision tower, for tests: the transformers checkpoint
(`Qwen3_5ForConditionalGeneration`, seeded, vision weights spread and exact in float16) with
Qwen3.5's real tokenizer and chat template, and its tower as llama.cpp's mmproj GGUF.

Text: the four-layer model of `qwen35_checkpoints.tiny_qwen35_config` (hidden 64, Qwen3.5's
whole 248,320-row vocabulary, tied embeddings). Vision: 2 blocks of hidden 32 (2 heads of 16),
MLP 64, patch 16, merge 2, temporal patch 2, a 4 x 4 grid of 16 learned positions, merged into
the text's 64. Image token ids are Qwen3.5's own (`<|image_pad|>` 248056, `<|vision_start|>`
248053, `<|vision_end|>` 248054); preprocessor_config.json is Qwen3.5's shipped one (256^2 to
4096^2 pixels, mean/std 0.5)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf_writing import finish, mmproj_writer
from qwen35_checkpoints import tiny_qwen35_config
from qwen35_tokenizer import write_qwen35_tokenizer

IMAGE_ID, VISION_START_ID, VISION_END_ID = 248056, 248053, 248054
PATCH_SIZE, MERGE_SIZE, NUM_POSITIONS = 16, 2, 16
MIN_PIXELS, MAX_PIXELS = 65_536, 16_777_216  # Qwen3.5's preprocessor_config.json
SEED = 3535


def tiny_qwen35_vlm_config(num_vision_layers: int = 2) -> Any:
    """The transformers config (see the module docstring)."""
    import transformers

    vision = transformers.Qwen3_5VisionConfig(
        depth=num_vision_layers, hidden_size=32, intermediate_size=64, num_heads=2,
        patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2,
        out_hidden_size=64, num_position_embeddings=NUM_POSITIONS)
    return transformers.Qwen3_5Config(
        text_config=tiny_qwen35_config().to_dict(), vision_config=vision.to_dict(),
        image_token_id=IMAGE_ID, vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID, tie_word_embeddings=True)


def write_tiny_qwen35_vlm(path: Path, num_vision_layers: int = 2) -> Path:
    """`path` holding a seeded tiny Qwen3_5ForConditionalGeneration (save_pretrained, float32),
    Qwen3.5's preprocessor_config.json and tokenizer (with its chat template). The vision
    weights are spread (norms 1 +- 0.5, the rest of std 0.2: transformers' init leaves norms
    at 1 and 0 and the rest small, which would hide a mix-up) and rounded to float16 values,
    so the mmproj GGUF (F16 matrices, as llama.cpp writes) holds them exactly."""
    import transformers

    torch.manual_seed(SEED)
    model = transformers.Qwen3_5ForConditionalGeneration(
        tiny_qwen35_vlm_config(num_vision_layers))
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.5 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2)
            param.copy_(param.half().float())
    model.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, patch_size=PATCH_SIZE,
        temporal_patch_size=2, merge_size=MERGE_SIZE, image_mean=[0.5] * 3,
        image_std=[0.5] * 3).save_pretrained(path)
    write_qwen35_tokenizer(path)
    return path


def write_qwen35_mmproj(path: Path, model_dir: Path) -> Path:
    """The tiny checkpoint's tower as llama.cpp's converter writes it with --mmproj
    (conversion/qwen3vl.py Qwen3VLVisionModel over MmprojModel, f16 output): arch "clip",
    projector "qwen3vl_merger", image_size sqrt(positions) * patch, the text's rms_norm_eps as
    the vision norms' eps, mean/std from preprocessor_config.json, no pixel bounds; the Conv3D
    patch kernel split along time into `v.patch_embd.weight` and `.weight.1`, the merger as
    `mm.0` / `mm.2` and `v.post_ln`, the rest by gguf's MMPROJ tensor map; matrices and
    kernels F16, the position table and 1-D tensors F32."""
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    vision, text = config["vision_config"], config["text_config"]
    preprocessor = json.loads((model_dir / "preprocessor_config.json").read_text())
    writer = mmproj_writer(
        path, projection_dim=text["hidden_size"],
        image_size=int(vision["num_position_embeddings"] ** 0.5 * vision["patch_size"]),
        patch_size=vision["patch_size"], hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_layers=vision["depth"],
        num_heads=vision["num_heads"], image_mean=preprocessor["image_mean"],
        image_std=preprocessor["image_std"])
    writer.add_clip_projector_type(gguf.VisionProjectorType.QWEN3VL)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(vision["spatial_merge_size"])
    writer.add_vision_attention_layernorm_eps(text["rms_norm_eps"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["depth"])
    merger = {"linear_fc1": "mm.0", "linear_fc2": "mm.2", "norm": "v.post_ln"}
    for key, tensor in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if not key.startswith("model.visual."):
            continue
        name = key.removeprefix("model.")
        if name == "visual.patch_embed.proj.weight":
            for suffix, frame in (("", 0), (".1", 1)):
                writer.add_tensor(f"v.patch_embd.weight{suffix}",
                                  tensor[:, :, frame].numpy().astype(np.float16))
            continue
        stem, _, kind = name.rpartition(".")
        if stem.startswith("visual.merger."):
            gguf_name = f"{merger[stem.removeprefix('visual.merger.')]}.{kind}"
        else:
            mapped = names.get_name(stem)
            assert mapped is not None, key
            gguf_name = f"{mapped}.{kind}"
        is_f16 = tensor.ndim >= 2 and gguf_name != "v.position_embd.weight"
        writer.add_tensor(gguf_name, tensor.numpy().astype(np.float16 if is_f16 else np.float32))
    finish(writer)
    return path

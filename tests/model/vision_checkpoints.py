"""A tiny Gemma 3 with its vision tower, for tests: the transformers checkpoint (seeded, norms
spread, vision weights exact in float16), its tower as llama.cpp's mmproj GGUF, and its text
half as llama.cpp's gemma3 GGUF.

Token layout: the default model's (SmolLM2's) 49,152 tokens, then five special tokens added in
this order: `<start_of_image>` 49152 (boi_token_index), `<end_of_image>` 49153
(eoi_token_index), `<image_soft_token>` 49154 (image_token_index), `<start_of_turn>` 49155,
`<end_of_turn>` 49156; the text vocabulary has 49,160 rows. The chat template is Google's
Gemma 3 template, image parts rendered as `<start_of_image>`."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from conftest import _spread_norm_weights
from gguf_writing import add_gemma3_tensors, add_shape, finish, mmproj_writer
from tokenizers import AddedToken

from nanoserve.bench.random_gemma3_vlm_gguf import (
    GEMMA3_ADDED_TOKENS,
    GEMMA3_CHAT_TEMPLATE,
    IMAGE_MEAN,
    IMAGE_STD,
    NUM_TEXT_ROWS,
)

BOI_ID, EOI_ID, IMAGE_ID = 49152, 49153, 49154
IMAGE_SIZE, PATCH_SIZE, TOKENS_PER_IMAGE = 64, 8, 4
# (the bench's random vision GGUFs share these: the text vocabulary's rows, the five added
# tokens, Google's chat template, and CLIP's mean and std, not transformers' 0.5 default, so
# a test sees them read from the file)
ADDED_TOKENS = GEMMA3_ADDED_TOKENS


def tiny_gemma3_vlm_config(num_vision_layers: int = 2) -> Any:
    """Text: 6 layers of hidden 64, five windowed (16 tokens) then one global, and a query
    scale of 1/sqrt(head_dim): what llama.cpp assumes for a gemma3 GGUF, so the text half can
    also be written as one; vision: SigLIP of hidden 32 on 64 x 64 images in 8 x 8
    patches, average-pooled to 4 soft tokens, no pooling head (as real Gemma 3)."""
    import transformers

    sliding, full = "sliding_attention", "full_attention"
    text = transformers.Gemma3TextConfig(
        vocab_size=NUM_TEXT_ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.05, sliding_window=16, query_pre_attn_scalar=32,
        layer_types=[sliding] * 5 + [full],
        rope_parameters={full: {"rope_type": "default", "rope_theta": 1000000.0},
                         sliding: {"rope_type": "default", "rope_theta": 10000.0}})
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=num_vision_layers,
        num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE,
        layer_norm_eps=1e-6, vision_use_head=False)
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI_ID, eoi_token_index=EOI_ID, image_token_index=IMAGE_ID)


def write_tiny_gemma3_vlm(path: Path, tokenizer: Any) -> Path:
    """`path` holding a seeded tiny Gemma3ForConditionalGeneration (save_pretrained), its
    preprocessor_config.json (64 x 64, CLIP's mean/std) and `tokenizer` with the five added
    special tokens, the boi/eoi/image names Gemma 3's tokenizer_config.json carries, and
    Google's chat template. Vision weights are rounded to float16 values, so the mmproj GGUF
    (F16 matrices, as llama.cpp writes) holds them exactly."""
    import transformers

    torch.manual_seed(1234)
    model = transformers.Gemma3ForConditionalGeneration(tiny_gemma3_vlm_config())
    _spread_norm_weights(model)  # 1 + w of 1.5-2.5: a norm run as plain w would show
    with torch.no_grad():
        projector = model.model.multi_modal_projector
        projector.mm_input_projection_weight.normal_(0.0, 0.2)  # transformers leaves zeros
        for name, param in model.named_parameters():
            if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
                param.copy_(param.half().float())
    model.save_pretrained(path)
    transformers.Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD)).save_pretrained(path)
    vlm_tokenizer = copy.deepcopy(tokenizer)
    vlm_tokenizer.add_special_tokens({"extra_special_tokens": [
        AddedToken(text, special=True, normalized=False) for text in ADDED_TOKENS]})
    assert vlm_tokenizer.convert_tokens_to_ids(list(ADDED_TOKENS)) == list(range(49152, 49157))
    vlm_tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    vlm_tokenizer.save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(boi_token="<start_of_image>", eoi_token="<end_of_image>",
                  image_token="<image_soft_token>")  # as Gemma 3's own tokenizer_config.json
    config_file.write_text(json.dumps(config, indent=2))
    return path


def _state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def write_gemma3_mmproj(path: Path, model_dir: Path) -> Path:
    """The tiny checkpoint's tower as llama.cpp's converter writes it with --mmproj
    (conversion/gemma.py Gemma3VisionModel over MmprojModel, default f16 output): arch "clip",
    projector "gemma3", the vision hyperparameters, mean/std from preprocessor_config.json;
    names from gguf's MMPROJ tensor map on the hub spelling (`vision_tower.vision_model.`),
    `_weight` -> `.weight`, soft_emb_norm stored as 1 + w; input_projection F16, the
    embeddings F32, other matrices F16, 1-D tensors F32."""
    config = json.loads((model_dir / "config.json").read_text())
    vision, text = config["vision_config"], config["text_config"]
    preprocessor = json.loads((model_dir / "preprocessor_config.json").read_text())
    writer = mmproj_writer(
        path, projection_dim=text["hidden_size"], image_size=vision["image_size"],
        patch_size=vision["patch_size"], hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"], image_mean=preprocessor["image_mean"],
        image_std=preprocessor["image_std"])
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vision["layer_norm_eps"])
    writer.add_vision_use_gelu(True)
    scale = (vision["image_size"] // vision["patch_size"]) // int(
        config["mm_tokens_per_image"] ** 0.5)
    if scale != 4:  # the converter writes it only where it is not llama.cpp's default
        writer.add_vision_projector_scale_factor(scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for key, tensor in sorted(_state_dict(model_dir).items()):
        name = key.removeprefix("model.")
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
        name = name.replace("_weight", ".weight")
        data = tensor.float()
        if "soft_emb_norm.weight" in name:
            data = data + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        is_f16 = "input_projection" in name or (data.ndim >= 2 and ".embeddings." not in name)
        writer.add_tensor(gguf_name, data.numpy().astype(np.float16 if is_f16 else np.float32))
    finish(writer)
    return path


def write_gemma3_text_gguf(path: Path, model_dir: Path) -> Path:
    """The text half of `model_dir` (write_tiny_gemma3_vlm's) as llama.cpp's gemma3 GGUF, its
    tensors in float32 (so it runs exactly as the directory does), the default model's
    tokenizer with the five added special tokens and Google's chat template."""
    import transformers

    from nanoserve.bench.gguf_tokenizer import add_default_tokenizer
    from nanoserve.model.gguf_file import GGUFFile
    from nanoserve.model.model_path import default_model_path
    from nanoserve.model.weights import text_weight_name

    cfg = transformers.AutoConfig.from_pretrained(model_dir).text_config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    add_shape(writer, cfg, cfg.rope_parameters["full_attention"]["rope_theta"], cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    add_default_tokenizer(writer, GGUFFile(default_model_path()).metadata,
                          chat_template=GEMMA3_CHAT_TEMPLATE, vocab_size=NUM_TEXT_ROWS,
                          added_tokens=ADDED_TOKENS)
    state = {text_weight_name(name): tensor for name, tensor in _state_dict(model_dir).items()}
    add_gemma3_tensors(writer, {name: tensor for name, tensor in state.items()
                                if name is not None})
    finish(writer)
    return path

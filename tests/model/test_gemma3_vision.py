"""Gemma 3's image side equals transformers': `normalize(resize(image))` is
Gemma3ImageProcessorPil's `pixel_values` bit for bit (odd sizes, 1x1, very wide, RGBA, P, L,
CMYK, LA); `expand_prompt` tokenizes as Gemma3Processor's ids; the vision tower equals
`get_image_features(...).pooler_output` within 1e-4 for one and two images, loaded from
safetensors of either spelling (reading no text shard) and from llama.cpp's mmproj GGUF;
a text-only model has no tower and no processor."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from vision_checkpoints import (
    BOI_ID,
    EOI_ID,
    IMAGE_ID,
    IMAGE_MEAN,
    IMAGE_STD,
    write_gemma3_mmproj,
    write_tiny_gemma3_vlm,
)

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.loader import default_model_path
from nanoserve.model.vision.gemma3_images import Gemma3ImageProcessor
from nanoserve.model.vision.siglip import Gemma3VisionTower
from nanoserve.model.vision.vision_weights import load_vision_tower

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    return write_tiny_gemma3_vlm(tmp_path_factory.mktemp("tiny-gemma3-vlm"), default_tokenizer)


@pytest.fixture(scope="module")
def vlm_tokenizer(vlm_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(vlm_dir))


@pytest.fixture(scope="module")
def hf_vlm(vlm_dir: Path) -> Any:
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(str(vlm_dir)).eval()


@pytest.fixture(scope="module")
def processor(vlm_dir: Path, vlm_tokenizer: Any) -> Gemma3ImageProcessor:
    made = Gemma3ImageProcessor.from_hf_dir(vlm_dir, vlm_tokenizer)
    assert made is not None
    return made


@pytest.fixture(scope="module")
def mmproj(vlm_dir: Path) -> Path:
    return write_gemma3_mmproj(vlm_dir.parent / "mmproj-tiny-gemma3.gguf", vlm_dir)


def _noise(width: int, height: int, channels: int, seed: int) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _images() -> dict[str, Image.Image]:
    palette = Image.fromarray(_noise(41, 29, 3, 5)).quantize(colors=16)
    transparent_palette = palette.copy()
    transparent_palette.info["transparency"] = 3
    return {
        "odd": Image.fromarray(_noise(37, 23, 3, 1)),
        "1x1": Image.fromarray(_noise(1, 1, 3, 2)),
        "wide": Image.fromarray(_noise(300, 7, 3, 3)),
        "tall_3_wide": Image.fromarray(_noise(3, 50, 3, 4)),  # 3 columns: not read as channels
        "rgba": Image.fromarray(_noise(45, 31, 4, 6), mode="RGBA"),
        "palette": palette,
        "palette_transparency": transparent_palette,
        "grayscale": Image.fromarray(_noise(33, 65, 1, 7), mode="L"),
        "cmyk": Image.fromarray(_noise(40, 40, 4, 8), mode="CMYK"),
        "la": Image.fromarray(_noise(20, 90, 2, 9), mode="LA"),
        "large": Image.fromarray(_noise(640, 480, 3, 10)),
    }


def _pixels(processor: Gemma3ImageProcessor, *images: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.stack([processor.normalize(processor.resize(i)) for i in images]))


def test_processor_reads_the_checkpoint(processor: Gemma3ImageProcessor) -> None:
    assert (processor.image_size, processor.tokens_per_image) == (64, 4)
    assert processor.image_mean == pytest.approx(IMAGE_MEAN)
    assert processor.image_std == pytest.approx(IMAGE_STD)
    assert (processor.boi_token_id, processor.eoi_token_id, processor.image_token_id) == \
        (BOI_ID, EOI_ID, IMAGE_ID)
    assert (processor.boi_token, processor.eoi_token, processor.image_token) == \
        ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


@pytest.mark.parametrize("name", list(_images()))
def test_pixels_equal_transformers(name: str, vlm_dir: Path,
                                   processor: Gemma3ImageProcessor) -> None:
    import transformers

    image = _images()[name]
    reference = transformers.Gemma3ImageProcessorPil.from_pretrained(str(vlm_dir))
    expected = reference(images=image, return_tensors="np")["pixel_values"][0]
    resized = processor.resize(image)
    assert resized.dtype == np.uint8 and resized.shape == (64, 64, 3)
    pixels = processor.normalize(resized)
    assert pixels.dtype == np.float32 and pixels.shape == expected.shape == (3, 64, 64)
    assert np.array_equal(pixels, expected), float(np.abs(pixels - expected).max())


def test_transparency_is_composited_over_white(processor: Gemma3ImageProcessor) -> None:
    clear = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    assert (processor.resize(clear) == 255).all()


def test_expanded_prompt_tokenizes_as_gemma3_processor(vlm_dir: Path, vlm_tokenizer: Any,
                                                       processor: Gemma3ImageProcessor) -> None:
    import transformers

    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "and"},
        {"type": "image"}]}]
    prompt = vlm_tokenizer.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
    assert prompt.endswith("<start_of_turn>user\nCompare<start_of_image>and<start_of_image>"
                           "<end_of_turn>\n<start_of_turn>model\n")
    reference = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil.from_pretrained(str(vlm_dir)),
        tokenizer=vlm_tokenizer, image_seq_length=processor.tokens_per_image)
    images = [_images()["odd"], _images()["rgba"]]
    expected = reference(text=prompt, images=images, return_tensors="np")
    ids = vlm_tokenizer(processor.expand_prompt(prompt))["input_ids"]
    assert ids == expected["input_ids"][0].tolist()
    assert ids.count(IMAGE_ID) == 8 and ids.count(BOI_ID) == ids.count(EOI_ID) == 2
    assert np.array_equal(np.stack([processor.normalize(processor.resize(i)) for i in images]),
                          expected["pixel_values"])


@pytest.fixture(scope="module")
def tower(vlm_dir: Path) -> Gemma3VisionTower:
    loaded = load_vision_tower(vlm_dir, None, torch.float32, CPU)
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("num_images", [1, 2])
def test_tower_equals_transformers(num_images: int, hf_vlm: Any, tower: Gemma3VisionTower,
                                   processor: Gemma3ImageProcessor) -> None:
    images = [_images()["large"], _images()["cmyk"]][:num_images]
    pixels = _pixels(processor, *images)
    with torch.no_grad():
        expected = hf_vlm.model.get_image_features(pixels).pooler_output
        got = tower(pixels)
    assert got.shape == expected.shape == (num_images, 4, 64)
    assert expected.abs().mean() > 0.1  # a projection left at zeros would pass vacuously
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("has_model_prefix", [False, True])
@pytest.mark.parametrize("has_vision_model", [False, True])
def test_both_safetensors_spellings_load(has_model_prefix: bool, has_vision_model: bool,
                                         vlm_dir: Path, tmp_path: Path,
                                         tower: Gemma3VisionTower,
                                         processor: Gemma3ImageProcessor) -> None:
    """Keys with and without `model.` and `vision_model.`, split into a vision shard and a
    text shard listed in the index but absent: the text shard is never opened."""
    from safetensors.torch import load_file, save_file

    vision: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(vlm_dir / "model.safetensors")).items():
        if key.startswith("vision_tower.") and has_vision_model:
            key = key.replace("vision_tower.", "vision_tower.vision_model.", 1)
        key = f"model.{key}" if has_model_prefix else key
        if "vision_tower." in key or "multi_modal_projector." in key:
            vision[key] = tensor
    save_file(vision, str(tmp_path / "model-00001-of-00002.safetensors"))
    weight_map = dict.fromkeys(vision, "model-00001-of-00002.safetensors")
    weight_map["model.language_model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((vlm_dir / "config.json").read_text())
    loaded = load_vision_tower(tmp_path, None, torch.float32, CPU)
    assert loaded is not None
    pixels = _pixels(processor, _images()["odd"])
    with torch.no_grad():
        assert torch.equal(loaded(pixels), tower(pixels))


def test_mmproj_gguf_equals_transformers(mmproj: Path, vlm_dir: Path, hf_vlm: Any,
                                         vlm_tokenizer: Any,
                                         processor: Gemma3ImageProcessor) -> None:
    gguf = GGUFFile(mmproj)
    types = {name: tensor.type_name for name, tensor in gguf.tensors.items()}
    assert types["mm.input_projection.weight"] == types["v.blk.0.attn_q.weight"] == "F16"
    assert types["v.patch_embd.weight"] == types["v.position_embd.weight"] == "F32"
    hf_norm = hf_vlm.model.multi_modal_projector.mm_soft_emb_norm.weight
    assert torch.equal(gguf.dequantize("mm.soft_emb_norm.weight"), hf_norm + 1)
    # the mmproj's processor is the directory's: same size, tokens and ids, and mean/std equal
    # as the float32 both normalize with (GGUF stores them as float32)
    from_mmproj = Gemma3ImageProcessor.from_mmproj(gguf.metadata, vlm_tokenizer)
    assert from_mmproj is not None
    for field in ("image_mean", "image_std"):
        assert np.array_equal(np.float32(getattr(from_mmproj, field)),
                              np.float32(getattr(processor, field)))
    assert replace(from_mmproj, image_mean=processor.image_mean,
                   image_std=processor.image_std) == processor
    loaded = load_vision_tower(default_model_path(), mmproj, torch.float32, CPU)
    assert loaded is not None
    pixels = _pixels(processor, _images()["wide"], _images()["palette"])
    with torch.no_grad():
        expected = hf_vlm.model.get_image_features(pixels).pooler_output
        torch.testing.assert_close(loaded(pixels), expected, atol=1e-4, rtol=0)


def test_a_text_only_model_has_no_tower(tiny_model_dir: Any, default_tokenizer: Any) -> None:
    text_only = tiny_model_dir("llama")
    assert load_vision_tower(text_only, None, torch.float32, CPU) is None
    assert Gemma3ImageProcessor.from_hf_dir(text_only, default_tokenizer) is None
    text_gguf = default_model_path()
    assert load_vision_tower(text_gguf, None, torch.float32, CPU) is None
    assert Gemma3ImageProcessor.from_mmproj(GGUFFile(text_gguf).metadata,
                                            default_tokenizer) is None
    with pytest.raises(ValueError, match="is not a Gemma 3 mmproj file"):
        load_vision_tower(text_gguf, text_gguf, torch.float32, CPU)


def test_the_processor_module_imports_no_torch() -> None:
    """The API process builds the processor and resizes images without torch."""
    script = ("import sys, nanoserve.model.vision.gemma3_images, nanoserve.model.vision\n"
              "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"

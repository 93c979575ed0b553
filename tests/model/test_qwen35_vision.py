"""Qwen3.5's image side equals transformers': `normalize(resize(image))` is
Qwen2VLImageProcessorPil's `pixel_values` and `image_grid_thw` bit for bit (odd sizes, tiny
images upscaled to the least area, very wide and tall, RGBA, P, L, LA, CMYK, large; the token
cap cuts as transformers' bound does); `expand_prompt` tokenizes as Qwen3VLProcessor's ids;
the vision tower equals `get_image_features(...).pooler_output` within 1e-4 for one and two
images of different sizes, loaded from safetensors and from llama.cpp's mmproj GGUF;
`mrope_positions` equals `get_rope_index` with 0, 1 and 2 images; a text-only model has no
Qwen3.5 tower or processor."""

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
from qwen35_vision_checkpoints import (
    IMAGE_ID,
    MAX_PIXELS,
    MIN_PIXELS,
    VISION_END_ID,
    VISION_START_ID,
    write_qwen35_mmproj,
    write_tiny_qwen35_vlm,
)

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.vision.mrope import mrope_positions
from nanoserve.model.vision.qwen35_images import DEFAULT_MAX_IMAGE_TOKENS, Qwen35ImageProcessor
from nanoserve.model.vision.qwen35_vit import Qwen35VisionTower
from nanoserve.model.vision.qwen35_weights import load_qwen35_vision
from nanoserve.model.vision.vision_weights import load_vision_tower

CPU = torch.device("cpu")
CAPPED_PIXELS = DEFAULT_MAX_IMAGE_TOKENS * 32 * 32


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny-qwen35-vlm"))


@pytest.fixture(scope="module")
def vlm_tokenizer(vlm_dir: Path) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(vlm_dir))


@pytest.fixture(scope="module")
def hf_vlm(vlm_dir: Path) -> Any:
    import transformers

    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(vlm_dir)).eval()


@pytest.fixture(scope="module")
def processor(vlm_dir: Path, vlm_tokenizer: Any) -> Qwen35ImageProcessor:
    made = Qwen35ImageProcessor.from_hf_dir(vlm_dir, vlm_tokenizer)
    assert made is not None
    return made


@pytest.fixture(scope="module")
def tower(vlm_dir: Path) -> Qwen35VisionTower:
    loaded = load_vision_tower(vlm_dir, None, torch.float32, CPU)
    assert isinstance(loaded, Qwen35VisionTower)
    return loaded


def _reference_processor(vlm_dir: Path, processor: Qwen35ImageProcessor) -> Any:
    """transformers' processor of the checkpoint, with our (capped) pixel bounds."""
    import transformers

    return transformers.Qwen2VLImageProcessorPil.from_pretrained(
        str(vlm_dir), size={"shortest_edge": processor.min_pixels,
                            "longest_edge": processor.max_pixels})


def _noise(width: int, height: int, channels: int, seed: int) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _images() -> dict[str, Image.Image]:
    palette = Image.fromarray(_noise(41, 29, 3, 5)).quantize(colors=16)
    transparent_palette = palette.copy()
    transparent_palette.info["transparency"] = 3
    return {
        "odd": Image.fromarray(_noise(301, 233, 3, 1)),
        "1x1": Image.fromarray(_noise(1, 1, 3, 2)),
        "wide": Image.fromarray(_noise(1000, 7, 3, 3)),
        "tall_3_wide": Image.fromarray(_noise(3, 50, 3, 4)),  # 3 columns: not read as channels
        "rgba": Image.fromarray(_noise(45, 31, 4, 6), mode="RGBA"),
        "palette": palette,
        "palette_transparency": transparent_palette,
        "grayscale": Image.fromarray(_noise(333, 265, 1, 7), mode="L"),
        "cmyk": Image.fromarray(_noise(40, 40, 4, 8), mode="CMYK"),
        "la": Image.fromarray(_noise(20, 90, 2, 9), mode="LA"),
        "large": Image.fromarray(_noise(640, 480, 3, 10)),
    }


def _encode(processor: Qwen35ImageProcessor,
            *images: Image.Image) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    pixels, grids = zip(*(processor.normalize(processor.resize(i)) for i in images),
                        strict=True)
    return torch.from_numpy(np.concatenate(pixels)), list(grids)


def test_processor_reads_the_checkpoint(processor: Qwen35ImageProcessor) -> None:
    assert (processor.patch_size, processor.merge_size, processor.patch_dim) == (16, 2, 1536)
    # the shipped 16,777,216 px cut to 4096 tokens' worth
    assert (processor.min_pixels, processor.max_pixels) == (MIN_PIXELS, CAPPED_PIXELS)
    assert processor.image_mean == processor.image_std == (0.5, 0.5, 0.5)
    assert (processor.image_token_id, processor.vision_start_token_id,
            processor.vision_end_token_id) == (IMAGE_ID, VISION_START_ID, VISION_END_ID)


@pytest.mark.parametrize("name", list(_images()))
def test_pixels_equal_transformers(name: str, vlm_dir: Path,
                                   processor: Qwen35ImageProcessor) -> None:
    image = _images()[name]
    expected = _reference_processor(vlm_dir, processor)(images=image, return_tensors="np")
    resized = processor.resize(image)
    assert resized.dtype == np.uint8 and resized.shape[2] == 3
    assert resized.shape[0] % 32 == 0 and resized.shape[1] % 32 == 0
    assert MIN_PIXELS <= resized.shape[0] * resized.shape[1] <= CAPPED_PIXELS
    pixels, grid = processor.normalize(resized)
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    assert pixels.dtype == np.float32 and pixels.shape == expected["pixel_values"].shape
    assert np.array_equal(pixels, expected["pixel_values"]), \
        float(np.abs(pixels - expected["pixel_values"]).max())
    assert processor.num_tokens(image.height, image.width) == grid[1] * grid[2] // 4 \
        == processor.num_tokens(*resized.shape[:2])


def test_the_cap_and_the_bounds(vlm_dir: Path, vlm_tokenizer: Any, tmp_path: Path,
                                processor: Qwen35ImageProcessor) -> None:
    """A preprocessor_config.json bound below the cap wins, as do its mean and std;
    `max_image_tokens=None` keeps the file's bound, a lower cap lowers it."""
    assert processor.num_tokens(1900, 2600) <= DEFAULT_MAX_IMAGE_TOKENS
    uncapped = Qwen35ImageProcessor.from_hf_dir(vlm_dir, vlm_tokenizer, max_image_tokens=None)
    assert uncapped is not None and uncapped.max_pixels == MAX_PIXELS
    assert uncapped.num_tokens(1900, 2600) == 59 * 81  # 1888 x 2592 px, no cut
    small = Qwen35ImageProcessor.from_hf_dir(vlm_dir, vlm_tokenizer, max_image_tokens=100)
    assert small is not None and small.num_tokens(1900, 2600) <= 100
    image = _images()["large"]  # 300 tokens uncut: cut as transformers cuts to the bound
    expected = _reference_processor(vlm_dir, small)(images=image, return_tensors="np")
    pixels, grid = small.normalize(small.resize(image))
    assert np.array_equal(pixels, expected["pixel_values"]) and grid == (1, 16, 22)
    (tmp_path / "config.json").write_text((vlm_dir / "config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 4096, "longest_edge": 200_000},
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.25, 0.25, 0.25]}))
    custom = Qwen35ImageProcessor.from_hf_dir(tmp_path, vlm_tokenizer)
    assert custom is not None
    assert (custom.min_pixels, custom.max_pixels) == (4096, 200_000)
    assert custom.image_mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert custom.resized_size(1, 1) == (64, 64) and custom.num_tokens(3000, 3000) == 169
    with pytest.raises(ValueError, match="aspect ratio"):
        processor.resize(Image.new("RGB", (403, 2)))


def test_expanded_prompt_tokenizes_as_qwen3vl_processor(vlm_tokenizer: Any, vlm_dir: Path,
                                                        processor: Qwen35ImageProcessor) -> None:
    import transformers

    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "and"},
        {"type": "image"}]}]
    prompt = vlm_tokenizer.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
    assert prompt.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    class ImagesOnly(transformers.Qwen3VLProcessor):
        """Qwen3VLProcessor with no video processor, whose class needs torchvision."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    reference = ImagesOnly(image_processor=_reference_processor(vlm_dir, processor),
                           tokenizer=vlm_tokenizer)
    images = [_images()["odd"], _images()["wide"]]
    expected = reference(text=prompt, images=images, return_tensors="np")
    counts = [processor.num_tokens(i.height, i.width) for i in images]
    ids = vlm_tokenizer(processor.expand_prompt(prompt, counts))["input_ids"]
    assert ids == expected["input_ids"][0].tolist()
    assert ids.count(IMAGE_ID) == sum(counts) and len(set(counts)) == 2
    pixels, grids = _encode(processor, *images)
    assert np.array_equal(pixels.numpy(), expected["pixel_values"])
    assert [list(g) for g in grids] == expected["image_grid_thw"].tolist()
    with pytest.raises(ValueError, match="2 image marker"):
        processor.expand_prompt(prompt, counts[:1])


@pytest.mark.parametrize("num_images", [1, 2])
def test_tower_equals_transformers(num_images: int, hf_vlm: Any, tower: Qwen35VisionTower,
                                   processor: Qwen35ImageProcessor) -> None:
    images = [_images()["large"], _images()["grayscale"]][:num_images]
    pixels, grids = _encode(processor, *images)
    with torch.no_grad():
        expected = hf_vlm.model.get_image_features(
            pixels, torch.tensor(grids)).pooler_output
        got = tower(pixels, grids)
    assert len(expected) == num_images
    expected_tokens = torch.cat(expected)
    assert got.shape == expected_tokens.shape == (
        sum(tower.num_tokens(g) for g in grids), 64)
    assert expected_tokens.abs().mean() > 0.1
    torch.testing.assert_close(got, expected_tokens, atol=1e-4, rtol=0)
    if num_images == 2:  # an image's tokens do not depend on the other image
        with torch.no_grad():
            alone = tower(pixels[:grids[0][1] * grids[0][2]], grids[:1])
        torch.testing.assert_close(got[:len(alone)], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefix", ["model.visual.", "visual."])
def test_a_split_checkpoint_reads_only_its_vision_shard(prefix: str, vlm_dir: Path,
                                                        tmp_path: Path,
                                                        tower: Qwen35VisionTower,
                                                        processor: Qwen35ImageProcessor) -> None:
    """The tower's keys (either spelling) in one shard; the text shard the index lists is
    absent, so opening it would fail."""
    from safetensors.torch import load_file, save_file

    vision = {key.replace("model.visual.", prefix, 1): tensor for key, tensor in
              load_file(str(vlm_dir / "model.safetensors")).items()
              if key.startswith("model.visual.")}
    save_file(vision, str(tmp_path / "model-00001-of-00002.safetensors"))
    weight_map = dict.fromkeys(vision, "model-00001-of-00002.safetensors")
    weight_map["model.language_model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((vlm_dir / "config.json").read_text())
    loaded = load_qwen35_vision(tmp_path, None, torch.float32, CPU)
    assert loaded is not None
    pixels, grids = _encode(processor, _images()["odd"])
    with torch.no_grad():
        assert torch.equal(loaded(pixels, grids), tower(pixels, grids))


def test_mmproj_gguf_equals_transformers(vlm_dir: Path, hf_vlm: Any, vlm_tokenizer: Any,
                                         processor: Qwen35ImageProcessor) -> None:
    mmproj = write_qwen35_mmproj(vlm_dir.parent / "mmproj-tiny-qwen35.gguf", vlm_dir)
    gguf = GGUFFile(mmproj)
    types = {name: tensor.type_name for name, tensor in gguf.tensors.items()}
    assert types["v.patch_embd.weight"] == types["v.patch_embd.weight.1"] == "F16"
    assert types["mm.0.weight"] == types["v.blk.1.attn_qkv.weight"] == "F16"
    from_mmproj = Qwen35ImageProcessor.from_mmproj(gguf.metadata, vlm_tokenizer)
    assert from_mmproj is not None
    assert replace(from_mmproj, image_mean=processor.image_mean,
                   image_std=processor.image_std) == processor
    assert np.array_equal(np.asarray(from_mmproj.image_mean, dtype=np.float32),
                          np.asarray(processor.image_mean, dtype=np.float32))
    loaded = load_vision_tower(vlm_dir, mmproj, torch.float32, CPU)
    assert isinstance(loaded, Qwen35VisionTower)
    pixels, grids = _encode(processor, _images()["wide"], _images()["rgba"])
    with torch.no_grad():
        expected = torch.cat(hf_vlm.model.get_image_features(
            pixels, torch.tensor(grids)).pooler_output)
        torch.testing.assert_close(loaded(pixels, grids), expected, atol=1e-4, rtol=0)


def _prompt_ids(processor: Qwen35ImageProcessor, vlm_tokenizer: Any,
                grids: list[tuple[int, int, int]]) -> list[int]:
    content: list[dict[str, str]] = [{"type": "text", "text": "Look:"}]
    for _ in grids:
        content += [{"type": "image"}, {"type": "text", "text": "then"}]
    prompt = vlm_tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                               tokenize=False, add_generation_prompt=True)
    counts = [t * h * w // 4 for t, h, w in grids]
    return list(vlm_tokenizer(processor.expand_prompt(prompt, counts))["input_ids"])


@pytest.mark.parametrize("grids", [[], [(1, 16, 20)], [(1, 34, 12), (1, 16, 16)]])
def test_mrope_positions_equal_transformers(grids: list[tuple[int, int, int]], hf_vlm: Any,
                                            vlm_tokenizer: Any,
                                            processor: Qwen35ImageProcessor) -> None:
    ids = _prompt_ids(processor, vlm_tokenizer, grids)
    positions, rope_delta = mrope_positions(ids, IMAGE_ID, grids, merge_size=2)
    input_ids = torch.tensor([ids])
    expected, expected_delta = hf_vlm.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE_ID).int(),
        image_grid_thw=torch.tensor(grids).view(-1, 3) if grids else None)
    assert positions.dtype == np.int64 and positions.shape == (3, len(ids))
    assert np.array_equal(positions, expected[:, 0].numpy())
    assert rope_delta == int(expected_delta) == (
        sum(max(h, w) // 2 - h * w // 4 for _, h, w in grids))
    with pytest.raises(ValueError, match="image tokens"):
        mrope_positions(ids, IMAGE_ID, [*grids, (1, 2, 2)], merge_size=2)


def test_a_text_only_model_has_no_qwen35_tower(tiny_model_dir: Any,
                                               default_tokenizer: Any) -> None:
    text_only = tiny_model_dir("llama")
    assert load_qwen35_vision(text_only, None, torch.float32, CPU) is None
    assert Qwen35ImageProcessor.from_hf_dir(text_only, default_tokenizer) is None


def test_the_processor_modules_import_no_torch() -> None:
    """The API process builds the processor, resizes images and computes positions without
    torch."""
    script = ("import sys, nanoserve.model.vision.qwen35_images, nanoserve.model.vision.mrope\n"
              "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"

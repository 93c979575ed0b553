"""Qwen3.5 with images through the engine equals transformers: a tiny random
Qwen3_5ForConditionalGeneration (tests/model/qwen35_vision_checkpoints.py), its tower run by
the engine's encoder on the processor's pixels, its placeholders and every later token turned
at multimodal RoPE's positions (the output's too, shifted by the prompt's rope delta), gives
transformers' greedy tokens alone, in chunks that end before images, and again from the prefix
cache; and the same from its text GGUF-free directory with llama.cpp's mmproj."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import make_engine
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from qwen35_vision_checkpoints import IMAGE_ID, write_tiny_qwen35_vlm
from test_qwen35_mrope import prompt_with

from nanoserve.engine.core import EngineCore
from nanoserve.model.vision.qwen35_images import Qwen35ImageProcessor
from nanoserve.protocol import ImageInput
from nanoserve.sampling_params import SamplingParams

NUM_NEW = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
SIZES = [(70, 100), (120, 64)]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny-qwen35-vlm"))


@pytest.fixture(scope="module")
def prompt(vlm_dir: Path) -> tuple[list[int], Any, list[int]]:
    """The prompt's ids, transformers' inputs and its greedy tokens (the whole sequence
    recomputed each step: no cache to trust)."""
    import transformers

    reference = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        vlm_dir, dtype=torch.float32).eval()
    ids, inputs = prompt_with(SIZES, vlm_dir)
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(NUM_NEW):
            sequence = torch.tensor([ids + tokens])
            logits = reference(**{**inputs, "input_ids": sequence,
                                  "mm_token_type_ids": (sequence == IMAGE_ID).long()}).logits
            tokens.append(int(logits[0, -1].argmax()))
    return ids, inputs, tokens


def image_inputs(vlm_dir: Path, ids: list[int]) -> list[ImageInput]:
    import transformers

    processor = Qwen35ImageProcessor.from_hf_dir(
        vlm_dir, transformers.AutoTokenizer.from_pretrained(vlm_dir))
    assert processor is not None
    rng = np.random.default_rng(len(SIZES))  # prompt_with's pictures
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                for w, h in SIZES]
    starts = [i for i, t in enumerate(ids) if t == IMAGE_ID and ids[i - 1] != IMAGE_ID]
    out = []
    for k, (start, picture) in enumerate(zip(starts, pictures, strict=True)):
        pixels = processor.resize(picture)
        grid = (1, pixels.shape[0] // 16, pixels.shape[1] // 16)
        out.append(ImageInput(start, grid[1] * grid[2] // 4, bytes([k]) * 16, pixels, grid))
    return out


def generate(engine: EngineCore, ids: list[int], images: list[ImageInput],
             rid: str = "r") -> tuple[list[int], int]:
    engine.add_request(rid, ids, GREEDY, images=images)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
    return tokens, cached


def test_greedy_tokens_equal_transformers(vlm_dir: Path, prompt: Any) -> None:
    ids, _, expected = prompt
    images = image_inputs(vlm_dir, ids)
    engine = make_engine(vlm_dir, block_size=16)
    assert generate(engine, ids, images) == (expected, 0)
    again, cached = generate(engine, ids, images, "again")  # its blocks and DeltaNet states
    assert again == expected and cached > images[-1].end - 32
    assert engine.runner.image_encoder is not None
    assert engine.runner.image_encoder.num_encoded == 2  # once per image
    chunked = make_engine(vlm_dir, max_num_batched_tokens=images[0].length + 8)
    assert generate(chunked, ids, images) == (expected, 0)


def test_the_same_from_its_mmproj(vlm_dir: Path, prompt: Any, tmp_path: Path) -> None:
    from qwen35_vision_checkpoints import write_qwen35_mmproj

    ids, _, expected = prompt
    mmproj = write_qwen35_mmproj(tmp_path / "mmproj-tiny-qwen35.gguf", vlm_dir)
    engine = make_engine(vlm_dir, mmproj=mmproj)
    assert generate(engine, ids, image_inputs(vlm_dir, ids))[0] == expected


def test_batched_and_preempted(vlm_dir: Path, prompt: Any) -> None:
    """The image prompt beside a text prompt and a second copy of itself with its images in
    another order of arrival: each its own positions and delta in one step's rows; then in a
    cache so small that requests are preempted and recompute."""
    import transformers

    ids, _, expected = prompt
    images = image_inputs(vlm_dir, ids)
    text_ids = ids[:12]
    reference = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        vlm_dir, dtype=torch.float32).eval()
    text_expected: list[int] = []
    with torch.inference_mode():
        for _ in range(NUM_NEW):
            logits = reference(input_ids=torch.tensor([text_ids + text_expected])).logits
            text_expected.append(int(logits[0, -1].argmax()))
    for engine in (make_engine(vlm_dir, max_num_batched_tokens=images[0].length + 8),
                   # room for one image prompt and a little: the second preempts
                   make_engine(vlm_dir, num_blocks=len(ids) // 16 + 3, block_size=16,
                               max_model_len=(len(ids) // 16 + 3) * 16,
                               max_num_batched_tokens=images[0].length + 8)):
        engine.add_request("text", text_ids, GREEDY)
        engine.add_request("a", ids, GREEDY, images=images)
        engine.add_request("b", ids, GREEDY, images=images)
        out: dict[str, list[int]] = {"text": [], "a": [], "b": []}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        assert out == {"text": text_expected, "a": expected, "b": expected}
    assert engine.stats.num_preemptions > 0

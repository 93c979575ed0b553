"""Qwen3.5's text half with images equals transformers: a tiny random
Qwen3_5ForConditionalGeneration's prompt logits with one and two images of different sizes,
its placeholder rows the tower's features (transformers' own, isolating the text half) and its
tokens turned by multimodal RoPE at 3-D positions (the step's rows standing in for the RoPE
table, interleaved sections [t, h, w]); plain positions would give other logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import make_engine
from PIL import Image
from qwen35_vision_checkpoints import IMAGE_ID, write_tiny_qwen35_vlm

from nanoserve.model.arch import ArchConfig
from nanoserve.model.attention.sdpa import PrefillChunk, SdpaBackend, SdpaMetadata
from nanoserve.model.hybrid_layers import HybridStates
from nanoserve.model.rope import mrope_axes
from nanoserve.model.vision.mrope import mrope_positions


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny-qwen35-vlm"))


@pytest.fixture(scope="module")
def reference(vlm_dir: Path) -> Any:
    import transformers

    return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        vlm_dir, dtype=torch.float32).eval()


def prompt_with(sizes: list[tuple[int, int]], vlm_dir: Path) -> tuple[list[int], Any]:
    """A chat prompt with one image of each size, and its inputs for transformers: the
    image processor's outputs and each `<|image_pad|>` repeated to its image's tokens, as
    Qwen3VLProcessor does (its video half needs torchvision, which is not installed)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(vlm_dir)
    rng = np.random.default_rng(len(sizes))
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for w, h in sizes]
    content: list[dict[str, Any]] = [{"type": "text", "text": "Compare these."}]
    content += [{"type": "image"} for _ in images]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         tokenize=False, add_generation_prompt=True)
    inputs = dict(image_processor(images, return_tensors="pt"))
    pad = "<|image_pad|>"
    pieces = text.split(pad)
    assert len(pieces) == len(images) + 1
    text = pieces[0] + "".join(pad * (int(grid.prod()) // 4) + piece
                               for grid, piece in zip(inputs["image_grid_thw"], pieces[1:],
                                                      strict=True))
    ids = tokenizer.encode(text, add_special_tokens=False)
    inputs["input_ids"] = torch.tensor([ids])
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE_ID).long()
    return ids, inputs


def test_interleaved_axes_follow_transformers() -> None:
    arch = ArchConfig.from_hf_config({
        "model_type": "qwen3_5_text", "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "intermediate_size": 64, "vocab_size": 100, "layer_types": ["full_attention"] * 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True, "partial_rotary_factor": 0.5}})
    assert arch.mrope_section == (2, 1, 1) and arch.mrope_interleaved
    half = mrope_axes(arch)[:16].tolist()
    assert half[:8] == [0, 1, 2, 0, 0, 0, 0, 0]  # h at 1, w at 2 (one pair each), else t


@pytest.mark.parametrize("sizes", [[(70, 100)], [(40, 90), (120, 64)]])
@torch.inference_mode()
def test_prompt_logits_with_images_equal_transformers(vlm_dir: Path, reference: Any,
                                                      sizes: list[tuple[int, int]]) -> None:
    ids, inputs = prompt_with(sizes, vlm_dir)
    grid = inputs["image_grid_thw"]
    theirs = reference(**inputs).logits[0].float()
    features = reference.model.get_image_features(inputs["pixel_values"], grid)
    features = torch.cat(list(getattr(features, "pooler_output", features)))
    positions, delta = mrope_positions(ids, IMAGE_ID, [tuple(g) for g in grid.tolist()], 2)
    hf_positions, hf_delta = reference.model.get_rope_index(
        inputs["input_ids"], mm_token_type_ids=inputs.get("mm_token_type_ids"),
        image_grid_thw=grid)
    assert np.array_equal(positions, hf_positions[:, 0].numpy()) and delta == int(hf_delta)

    engine = make_engine(vlm_dir)
    runner, n = engine.runner, len(ids)
    attention = SdpaBackend(block_size=runner.block_size, num_kv_heads=runner.num_kv_heads,
                            num_blocks=runner.num_blocks, device=runner.device)
    pool = runner.state_pool
    assert pool is not None
    rows = torch.tensor([i for i, t in enumerate(ids) if t == IMAGE_ID])

    def logits(rope: torch.Tensor | None) -> torch.Tensor:
        pool.conv[0].zero_()
        pool.ssm[0].zero_()
        states = HybridStates(pool.conv, pool.ssm, torch.tensor([0], dtype=torch.int32),
                              torch.tensor([0, n], dtype=torch.int32),
                              torch.full((n,), -1, dtype=torch.int32))
        hidden = runner.plan.forward(
            torch.tensor(ids), torch.arange(n), runner.kv_caches, attention,
            SdpaMetadata(cache_index=torch.arange(n), prefills=[PrefillChunk(0, n, n)]),
            states=states, images=(rows, features), rope_positions=rope)
        return runner.model.compute_logits(hidden)

    ours = logits(torch.from_numpy(positions))
    error = (ours - theirs).abs().max().item()
    assert error < 1e-4 * theirs.abs().max().item(), f"{error:.2e}"
    plain = logits(None)  # 1-D positions: the test above can fail
    assert (plain - theirs).abs().max().item() > 1e-3

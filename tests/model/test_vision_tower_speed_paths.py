"""The vision towers' quantized forms (model/vision/tower_matmul.py): in a quantized mode the
matmul weights are Q8_0 weights the int8 kernels multiply (or bfloat16 ones on an AMX-BF16 CPU),
and the features stay close to the float32 tower's; mode "none" keeps float32 tensors.

Tolerance: both forms round every weight and every matmul input to about 8 significant bits
(Q8_0: 1/127 of a block's largest value; bfloat16: a 2^-9 relative step), which over the tiny
towers' 2 layers and wide weights (std 0.2) moves the features by ~1% of their norm; a cosine
above 0.999 (the bar the real-size towers meet, docs/benchmarks.md) and a relative error
under 5% hold that, while a wrong weight layout or a skipped bias gives a cosine far below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from qwen35_vision_checkpoints import write_tiny_qwen35_vlm
from vision_checkpoints import IMAGE_SIZE, write_tiny_gemma3_vlm

from nanoserve.model.quant_linear import QuantizedWeight
from nanoserve.model.vision import tower_matmul
from nanoserve.model.vision.qwen35_vit import Qwen35VisionTower
from nanoserve.model.vision.siglip import Gemma3VisionTower
from nanoserve.model.vision.tower_matmul import Bf16Weight, tower_form
from nanoserve.model.vision.vision_weights import load_vision_tower
from nanoserve.native import load_kernels

CPU = torch.device("cpu")
MIN_COSINE = 0.999
MAX_RELATIVE_ERROR = 5e-2
FORM_CLASSES: dict[str, type] = {"int8": QuantizedWeight, "bf16": Bf16Weight}


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    return write_tiny_gemma3_vlm(tmp_path_factory.mktemp("tiny-gemma3-vlm"), default_tokenizer)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny-qwen35-vlm"))


@pytest.fixture
def cpu_with(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Makes `tower_form` see a CPU with exactly the given flags."""
    def pretend(*flags: str) -> None:
        monkeypatch.setattr(tower_matmul, "cpu_flags", lambda: frozenset(flags))
    return pretend


def _pretend_for(form: str, cpu_with: Any) -> None:
    if form == "int8" and load_kernels("quant_matmul") is None:
        pytest.skip("the int8 kernels do not build here")
    cpu_with(*(("avx2", "amx_bf16") if form == "bf16" else ("avx2",)))


def _assert_close_to(got: torch.Tensor, expected: torch.Tensor) -> None:
    got, expected = got.float().flatten(), expected.float().flatten()
    assert expected.norm() > 1.0  # features left at zeros would pass vacuously
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=0).item()
    relative = ((got - expected).norm() / expected.norm()).item()
    assert cosine > MIN_COSINE, cosine
    assert relative < MAX_RELATIVE_ERROR, relative
    assert not torch.equal(got, expected)  # the quantized path did run


def test_form_follows_the_mode_and_the_cpu(cpu_with: Any) -> None:
    cpu_with("avx2", "avx512f", "amx_bf16")
    assert tower_form("none", CPU) == "float32"
    assert tower_form("int8", torch.device("cuda")) == "float32"
    assert tower_form("int8", CPU) == tower_form("gguf", CPU) == "bf16"
    cpu_with("avx2", "avx512f", "avx512_vnni")
    assert tower_form("int8", CPU) == tower_form("fp16", CPU) == "int8"
    with pytest.raises(ValueError, match="tower form"):
        tower_matmul.tower_matmul(torch.zeros(4, 32), "int4")


def _gemma_pixels(num_images: int) -> torch.Tensor:
    rng = np.random.default_rng(7)
    return torch.from_numpy(rng.uniform(-1, 1, (num_images, 3, IMAGE_SIZE, IMAGE_SIZE))
                            .astype(np.float32))


@pytest.mark.parametrize("form", ["int8", "bf16"])
def test_quantized_gemma_tower_is_close_to_float32(form: str, gemma_dir: Path,
                                                   cpu_with: Any) -> None:
    exact = load_vision_tower(gemma_dir, None, torch.float32, CPU)
    _pretend_for(form, cpu_with)
    quantized = load_vision_tower(gemma_dir, None, torch.float32, CPU, quantization="int8")
    assert isinstance(exact, Gemma3VisionTower) and isinstance(quantized, Gemma3VisionTower)
    layer = quantized.weights.layers[0]
    for weight in (layer.qkv_weight, layer.out_weight, layer.fc1_weight, layer.fc2_weight,
                   quantized.weights.input_projection):
        assert isinstance(weight, FORM_CLASSES[form])
    assert isinstance(exact.weights.layers[0].qkv_weight, torch.Tensor)
    pixels = _gemma_pixels(2)
    with torch.no_grad():
        expected, got = exact(pixels), quantized(pixels)
    assert got.shape == expected.shape == (2, 4, 64) and got.dtype == torch.float32
    _assert_close_to(got, expected)


def _qwen_pixels(tower: Qwen35VisionTower, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    num_patches = sum(t * h * w for t, h, w in grids)
    rng = np.random.default_rng(8)
    return torch.from_numpy(rng.uniform(-1, 1, (num_patches, tower.arch.patch_dim))
                            .astype(np.float32))


@pytest.mark.parametrize("form", ["int8", "bf16"])
def test_quantized_qwen_tower_is_close_to_float32(form: str, qwen_dir: Path,
                                                  cpu_with: Any) -> None:
    exact = load_vision_tower(qwen_dir, None, torch.float32, CPU)
    _pretend_for(form, cpu_with)
    quantized = load_vision_tower(qwen_dir, None, torch.float32, CPU, quantization="gguf")
    assert isinstance(exact, Qwen35VisionTower) and isinstance(quantized, Qwen35VisionTower)
    weights, block = quantized.weights, quantized.weights.blocks[0]
    for weight in (weights.patch_weight, block.qkv_weight, block.out_weight, block.fc1_weight,
                   block.fc2_weight, weights.merger_fc1_weight, weights.merger_fc2_weight):
        assert isinstance(weight, FORM_CLASSES[form])
    grids = [(1, 4, 6), (1, 2, 2)]  # two images: attention stays inside each
    pixels = _qwen_pixels(exact, grids)
    with torch.no_grad():
        expected, got = exact(pixels, grids), quantized(pixels, grids)
    assert got.shape == expected.shape == (7, 64) and got.dtype == torch.float32
    _assert_close_to(got, expected)


def test_int8_keeps_a_weight_off_the_block_size_in_float32() -> None:
    """SigLIP-So400m's fc2 has 4304 inputs, not a multiple of Q8_0's 32."""
    odd = tower_matmul.tower_matmul(torch.randn(8, 48), "int8")
    assert isinstance(odd, torch.Tensor) and odd.shape == (8, 48)
    if load_kernels("quant_matmul") is not None:
        assert isinstance(tower_matmul.tower_matmul(torch.randn(8, 64), "int8"), QuantizedWeight)

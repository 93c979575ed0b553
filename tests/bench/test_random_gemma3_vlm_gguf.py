"""The random Gemma 3 with images for `bench serve --image-size` (bench/random_gemma3_vlm_gguf.py,
bench/image_load.py), at a tiny width: the mmproj loads in nanoserve's vision tower with the
shape it was written at and runs; the text file's tokenizer has Gemma 3's three image tokens as
single special tokens, its template writes an image part as `<start_of_image>`, and the image
processor built from both files finds their ids; the requests carry an image of their own
each. No llama-server is started."""

from __future__ import annotations

import argparse
import base64
import io
from pathlib import Path

import gguf
import pytest
import torch
from PIL import Image

from nanoserve.bench.image_load import (
    CHAT_PATH,
    image_bodies,
    mmproj_tokens_per_image,
    parse_image_size,
    random_png,
)
from nanoserve.bench.random_gemma3_vlm_gguf import (
    GEMMA3_ADDED_TOKENS,
    GEMMA3_TEXT,
    NUM_TEXT_ROWS,
    SIGLIP_B14_448,
    Gemma3TextShape,
    SiglipShape,
    write_random_gemma3_mmproj,
    write_random_gemma3_text_gguf,
)
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.loader import gguf_arch
from nanoserve.model.tokenizer import load_tokenizer_from_gguf
from nanoserve.model.vision.gemma3_images import Gemma3ImageProcessor
from nanoserve.model.vision.siglip import SiglipArch
from nanoserve.model.vision.vision_weights import load_vision_tower

CPU = torch.device("cpu")
TINY_TEXT = Gemma3TextShape(hidden=64, layers=6, heads=2, kv_heads=1, head_dim=32,
                            intermediate=128, sliding_window=16)
# 56 / 14 = 4 patches a side pooled 2 x 2: 4 tokens, and a scale factor the file must state
TINY_TOWER = SiglipShape(hidden=32, layers=2, heads=2, intermediate=64, image_size=56,
                         patch_size=14, scale=2)


@pytest.fixture(scope="module")
def text_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gemma3-vlm") / "text.gguf"
    return write_random_gemma3_text_gguf(out, TINY_TEXT, gguf.GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gemma3-vlm") / "mmproj.gguf"
    return write_random_gemma3_mmproj(out, TINY_TOWER, text_hidden=TINY_TEXT.hidden)


def test_the_bench_shapes_are_a_users() -> None:
    assert SIGLIP_B14_448.tokens_per_image == 64  # 32 x 32 patches pooled 4 x 4
    assert GEMMA3_TEXT.heads * GEMMA3_TEXT.head_dim == 1024  # Gemma 3 270M's attention


def test_the_mmproj_loads_in_the_vision_tower_and_runs(text_gguf: Path, mmproj: Path) -> None:
    tower = load_vision_tower(text_gguf, mmproj, torch.float32, CPU)
    assert tower is not None
    arch = tower.arch
    assert isinstance(arch, SiglipArch)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.intermediate_size) == \
        (32, 2, 2, 64)
    assert (arch.image_size, arch.patch_size, arch.tokens_per_image, arch.text_hidden_size) == \
        (56, 14, 4, 64)
    meta = GGUFFile(mmproj).metadata
    assert meta["clip.projector_type"] == "gemma3" and meta["clip.use_gelu"] is True
    assert meta["clip.vision.projector.scale_factor"] == 2
    assert mmproj_tokens_per_image(mmproj) == 4
    out = tower(torch.randn(2, 3, 56, 56))
    assert out.shape == (2, 4, 64) and torch.isfinite(out).all()


def test_the_default_scale_factor_is_left_unstated(tmp_path: Path) -> None:
    """llama.cpp's converter writes the key only where it is not 4 (its default)."""
    shape = SiglipShape(hidden=32, layers=1, heads=2, intermediate=64, image_size=112,
                        patch_size=14)
    path = write_random_gemma3_mmproj(tmp_path / "m.gguf", shape, text_hidden=64)
    assert "clip.vision.projector.scale_factor" not in GGUFFile(path).metadata
    assert mmproj_tokens_per_image(path) == 4


def test_the_text_file_has_gemma3s_image_tokens(text_gguf: Path, mmproj: Path) -> None:
    file = GGUFFile(text_gguf)
    assert file.metadata["general.architecture"] == "gemma3"
    assert len(file.metadata["tokenizer.ggml.tokens"]) == NUM_TEXT_ROWS
    arch = gguf_arch(file)
    assert (arch.family, arch.num_layers, arch.head_dim, arch.sliding_window) == \
        ("gemma3", 6, 32, 16)
    tokenizer = load_tokenizer_from_gguf(file)
    ids = tokenizer.convert_tokens_to_ids(list(GEMMA3_ADDED_TOKENS))
    assert ids == list(range(49152, 49157))
    assert tokenizer("<start_of_image><image_soft_token><end_of_image>")["input_ids"] == \
        [49152, 49154, 49153]
    processor = Gemma3ImageProcessor.from_mmproj(GGUFFile(mmproj).metadata, tokenizer)
    assert processor is not None
    assert (processor.boi_token_id, processor.image_token_id, processor.eoi_token_id,
            processor.tokens_per_image, processor.image_size) == (49152, 49154, 49153, 4, 56)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}],
        tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<start_of_turn>user\n<start_of_image>what<end_of_turn>\n"
                             "<start_of_turn>model\n")


def test_each_request_has_an_image_of_its_own() -> None:
    assert parse_image_size("640x480") == (640, 480)
    for bad in ("640", "0x480", "ax b", ""):
        with pytest.raises(ValueError, match="--image-size needs WIDTHxHEIGHT"):
            parse_image_size(bad)
    bodies = image_bodies("m", ["one two", "three"], (40, 24), 8, seed=5)
    urls = [b["messages"][0]["content"][0]["image_url"]["url"] for b in bodies]
    assert len(set(urls)) == 2 and all(u.startswith("data:image/png;base64,") for u in urls)
    image = Image.open(io.BytesIO(base64.b64decode(urls[0].split(",", 1)[1])))
    assert (image.format, image.size, image.mode) == ("PNG", (40, 24), "RGB")
    assert random_png(40, 24, 5) == base64.b64decode(urls[0].split(",", 1)[1])
    body = bodies[1]
    assert body["messages"][0]["content"][1] == {"type": "text", "text": "three"}
    assert (body["max_tokens"], body["ignore_eos"], body["stream"], body["temperature"]) == \
        (8, True, True, 0)
    assert CHAT_PATH == "/v1/chat/completions"


def test_bench_serve_sends_chat_requests_with_images_only_when_asked(mmproj: Path) -> None:
    from nanoserve.bench.serve import image_tokens, level_bodies, mmproj_args

    plain = argparse.Namespace(image_size=None, mmproj=None)
    bodies, path = level_bodies("m", plain, ["a b"], 4, seed=1)
    assert path == "/v1/completions" and bodies[0]["prompt"] == "a b"
    assert (image_tokens(plain), mmproj_args(plain)) == (0, [])
    images = argparse.Namespace(image_size="32x32", mmproj=str(mmproj))
    bodies, path = level_bodies("m", images, ["a b", "c"], 4, seed=1)
    assert path == CHAT_PATH and len(bodies) == 2
    assert image_tokens(images) == 4 and mmproj_args(images) == ["--mmproj", str(mmproj)]


def test_images_without_an_mmproj_are_refused_before_any_server_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    from nanoserve.bench.serve import run_serve_bench

    args = argparse.Namespace(concurrency="1", image_size="64x64", mmproj=None, url=None)
    assert run_serve_bench(args) == 2
    assert "--image-size needs --mmproj" in capsys.readouterr().err
    args.image_size = "64"
    assert run_serve_bench(args) == 2
    assert "--image-size needs WIDTHxHEIGHT" in capsys.readouterr().err

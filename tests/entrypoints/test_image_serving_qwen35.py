"""Qwen3.5 with images through the real server: an OpenAI `image_url` and an Ollama image on a
tiny random Qwen3_5ForConditionalGeneration give the tokens of an engine call on the rendered
ids and the processor's pixels (placeholders as many as the image's size makes); an image
more elongated than the model takes is a 400."""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from helpers import make_engine
from PIL import Image
from server_harness import RunningServer

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from qwen35_vision_checkpoints import IMAGE_ID, write_tiny_qwen35_vlm

from nanoserve.model.vision.qwen35_images import Qwen35ImageProcessor
from nanoserve.protocol import ImageInput
from nanoserve.sampling_params import SamplingParams

NUM_NEW = 4


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny-qwen35-vlm"))


@pytest.fixture(scope="module")
def server(vlm_dir: Path) -> Iterator[RunningServer]:
    running = RunningServer("--model", str(vlm_dir))
    yield running
    running.stop()


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def engine_text(vlm_dir: Path, ids: list[int], data: bytes) -> str:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    processor = Qwen35ImageProcessor.from_hf_dir(vlm_dir, tokenizer)
    assert processor is not None
    pixels = processor.resize(Image.open(io.BytesIO(data)))
    grid = (1, pixels.shape[0] // 16, pixels.shape[1] // 16)
    start = ids.index(IMAGE_ID)
    engine = make_engine(vlm_dir)
    engine.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=NUM_NEW,
                                                ignore_eos=True),
                       images=[ImageInput(start, ids.count(IMAGE_ID), bytes(16), pixels, grid)])
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def test_an_image_gives_the_engine_tokens(server: RunningServer, vlm_dir: Path) -> None:
    data = png(90, 50, 1)
    url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    model = server.client().models.list().data[0].id
    ids = server.post("/v1/chat/completions/render",
                      {"model": model, "messages": messages}).json()["token_ids"]
    # 90 x 50 px scaled up to 65,536 px at least, sides in 32s: 352 x 192, 11 x 6 merged tokens
    assert ids.count(IMAGE_ID) == 66
    answer = server.client().chat.completions.create(
        model=model, messages=messages, max_tokens=NUM_NEW, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True, "skip_special_tokens": True})
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == engine_text(vlm_dir, ids, data)


def test_an_image_too_elongated_is_a_400(server: RunningServer) -> None:
    url = f"data:image/png;base64,{base64.b64encode(png(1000, 4, 2)).decode()}"
    with pytest.raises(openai.BadRequestError, match="aspect ratio"):
        server.client().chat.completions.create(
            model=server.client().models.list().data[0].id, max_tokens=1,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}]}])

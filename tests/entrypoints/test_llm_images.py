"""`LLM.chat` takes OpenAI's `image_url` parts, as vLLM's does: on a tiny random Gemma 3 with
its tower the offline answer is the server's (the same ids and pixels, through the same
intake); a bad image is a ValueError naming the part, and a text-only model says vLLM's
"At most 0 image(s)"."""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from server_harness import RunningServer

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from vision_checkpoints import write_tiny_gemma3_vlm

from nanoserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    return write_tiny_gemma3_vlm(tmp_path_factory.mktemp("tiny-gemma3-vlm"), default_tokenizer)


@pytest.fixture(scope="module")
def llm(vlm_dir: Path) -> Iterator[LLM]:
    yield LLM(str(vlm_dir), quantization="none")


def conversation(seed: int, data: bytes | None = None) -> list[dict[str, Any]]:
    if data is None:
        out = io.BytesIO()
        pixels = np.random.default_rng(seed).integers(0, 256, (30, 45, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(out, "PNG")
        data = out.getvalue()
    url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    return [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def test_an_image_gives_the_servers_answer(llm: LLM, vlm_dir: Path) -> None:
    offline = llm.chat(conversation(1), GREEDY, use_tqdm=False)[0]
    server = RunningServer("--model", str(vlm_dir))
    try:
        answer = server.client().chat.completions.create(
            model=server.client().models.list().data[0].id, messages=conversation(1),  # type: ignore[arg-type]
            max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    finally:
        server.stop()
    assert offline.outputs[0].text == answer.choices[0].message.content
    assert len(offline.prompt_token_ids) == answer.usage.prompt_tokens  # type: ignore[union-attr]
    two = llm.chat([conversation(1), conversation(2)], GREEDY, use_tqdm=False)
    assert two[0].outputs[0].text == offline.outputs[0].text


def test_bad_images_are_value_errors(llm: LLM, tiny_model_dir: Any) -> None:
    with pytest.raises(ValueError, match=r"messages\.0\.content\.1.*could not be decoded"):
        llm.chat(conversation(0, b"not a png"), GREEDY, use_tqdm=False)
    text_only = LLM(str(tiny_model_dir("llama")), quantization="none")
    with pytest.raises(ValueError, match=r"At most 0 image\(s\) may be provided"):
        text_only.chat(conversation(0), GREEDY, use_tqdm=False)

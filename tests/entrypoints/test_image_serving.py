"""Images through the real server and the official SDKs, on a tiny random Gemma 3 with its
vision tower (tests/model/vision_checkpoints.py): an image in each API's shape (PNG, JPEG and
WebP as OpenAI `image_url`, Responses `input_image`, an Anthropic `image` block, Ollama's
`images`) gives the tokens of an engine call on the same ids and pixels; the same image hits
the prefix cache (`cached_tokens`), another image misses it after the text before it, a
restarted server over `--kv-cache-disk` hits it too; the model says it sees (Ollama's
`vision` capability, /v1/models' input modalities); too many images and bad bytes are 400s,
and the server serves on."""

from __future__ import annotations

import base64
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
from helpers import make_engine
from image_files import png_header
from PIL import Image
from server_harness import RunningServer

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from vision_checkpoints import GEMMA3_CHAT_TEMPLATE, IMAGE_ID, write_tiny_gemma3_vlm

from nanoserve.model.vision.gemma3_images import Gemma3ImageProcessor
from nanoserve.protocol import ImageInput
from nanoserve.sampling_params import SamplingParams

NUM_NEW = 6
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    return write_tiny_gemma3_vlm(tmp_path_factory.mktemp("tiny-gemma3-vlm"), default_tokenizer)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def server(vlm_dir: Path, disk: Path) -> Iterator[RunningServer]:
    # Gemma 3's template less its check that roles alternate, so a tool turn renders (it
    # renders every alternating conversation as Gemma's does)
    template = disk.parent / "gemma3-with-tools.jinja"
    template.write_text(GEMMA3_CHAT_TEMPLATE.replace(
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/"
        "...') }}", ""))
    running = RunningServer("--model", str(vlm_dir), "--block-size", "4",
                            "--kv-cache-disk", str(disk), "--limit-mm-per-prompt",
                            '{"image": 2}', "--chat-template", str(template))
    yield running
    running.stop()


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))


def data_url(data: bytes, fmt: str) -> str:
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(data).decode()}"


def engine_text(vlm_dir: Path, ids: list[int], images: list[bytes]) -> str:
    """The engine's greedy answer to `ids` with `images` (file bytes, decoded here)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    processor = Gemma3ImageProcessor.from_hf_dir(vlm_dir, tokenizer)
    assert processor is not None
    starts = [i for i, t in enumerate(ids) if t == IMAGE_ID and ids[i - 1] != IMAGE_ID]
    assert len(starts) == len(images)
    inputs = [ImageInput(start, processor.tokens_per_image, bytes(16),
                         processor.resize(Image.open(io.BytesIO(data))))
              for start, data in zip(starts, images, strict=True)]
    engine = make_engine(vlm_dir)
    engine.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=NUM_NEW,
                                                ignore_eos=True), images=inputs)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def template_ids(vlm_dir: Path, content: list[dict[str, Any]]) -> list[int]:
    """The ids of one user turn holding `content` (text and image parts), as the server
    renders and expands it."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    processor = Gemma3ImageProcessor.from_hf_dir(vlm_dir, tokenizer)
    assert processor is not None
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                           tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(processor.expand_prompt(prompt), add_special_tokens=False))


def model_id(server: RunningServer) -> str:
    return server.client().models.list().data[0].id


def openai_chat(server: RunningServer, url: str, text: str = QUESTION) -> Any:
    return server.client().chat.completions.create(
        model=server.client().models.list().data[0].id, max_tokens=NUM_NEW, temperature=0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}])


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_openai_image_url_gives_the_engine_tokens(server: RunningServer, vlm_dir: Path,
                                                  fmt: str) -> None:
    data = encoded(picture(1), fmt)
    answer = openai_chat(server, data_url(data, fmt))
    rendered = server.post("/v1/chat/completions/render", {
        "model": model_id(server), "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": data_url(data, fmt)}}]}]}).json()
    ids = rendered["token_ids"]
    assert ids.count(IMAGE_ID) == 4 and answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == engine_text(vlm_dir, ids, [data])


def test_every_api_shape_gives_the_engine_tokens(server: RunningServer, vlm_dir: Path) -> None:
    data = encoded(picture(2), "PNG")
    b64 = base64.b64encode(data).decode()
    image_first = engine_text(vlm_dir, template_ids(vlm_dir, [
        {"type": "image"}, {"type": "text", "text": QUESTION}]), [data])
    text_first = engine_text(vlm_dir, template_ids(vlm_dir, [
        {"type": "text", "text": QUESTION}, {"type": "image"}]), [data])
    model = server.client().models.list().data[0].id

    responses = server.client().responses.create(
        model=model, max_output_tokens=NUM_NEW, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [
            {"type": "input_text", "text": QUESTION},
            {"type": "input_image", "image_url": data_url(data, "PNG"), "detail": "auto"}]}])
    assert responses.output_text == text_first

    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    message = claude.messages.create(
        model=model, max_tokens=NUM_NEW, extra_body={"ignore_eos": True, "temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == image_first  # type: ignore[union-attr]

    chat = ollama.Client(host=server.url).chat(
        model=model, messages=[{"role": "user", "content": QUESTION, "images": [data]}],
        options={"temperature": 0, "num_predict": NUM_NEW, "ignore_eos": True})
    assert chat.message.content == text_first


def test_counts_hold_the_images_placeholders(server: RunningServer) -> None:
    """Anthropic's count_tokens (what Claude Code sizes its context by) and /tokenize count
    an image's placeholders, as the request's usage does."""
    data = encoded(picture(2), "PNG")
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    messages: Any = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(data).decode()}},
        {"type": "text", "text": QUESTION}]}]
    counted = claude.messages.count_tokens(model=model_id(server), messages=messages)
    answered = claude.messages.create(model=model_id(server), max_tokens=1, messages=messages)
    usage = answered.usage  # (Anthropic's input_tokens leave out what the cache read)
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    openai_messages = [{"role": "user", "content": [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": data_url(data, "PNG")}}]}]
    tokenized = server.post("/tokenize", {"model": model_id(server),
                                          "messages": openai_messages}).json()
    rendered = server.post("/v1/chat/completions/render", {
        "model": model_id(server), "messages": openai_messages}).json()["token_ids"]
    assert tokenized["tokens"] == rendered and rendered.count(IMAGE_ID) == 4


def test_an_image_inside_a_tool_result_reaches_the_model(server: RunningServer) -> None:
    """Claude Code's Read tool answers with a screenshot inside `tool_result`: the image's
    placeholders are in the prompt (its input tokens count them), not dropped."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    b64 = base64.b64encode(encoded(picture(3), "PNG")).decode()

    def ask(result: list[dict[str, Any]]) -> Any:
        return claude.messages.create(
            model=model_id(server), max_tokens=2, extra_body={"temperature": 0},
            tools=[{"name": "read", "description": "read a file",
                    "input_schema": {"type": "object", "properties": {}}}],
            messages=[
                {"role": "user", "content": "Look at shot.png"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": result}]}])

    with_image = ask([{"type": "text", "text": "the file:"},
                      {"type": "image", "source": {"type": "base64",
                                                   "media_type": "image/png", "data": b64}}])
    without = ask([{"type": "text", "text": "the file:"}])
    assert with_image.usage.input_tokens >= without.usage.input_tokens + 4


def test_the_model_says_it_sees(server: RunningServer) -> None:
    card = server.client().models.list().data[0]
    assert card.input_modalities == ["text", "image"]  # type: ignore[attr-defined]
    shown = ollama.Client(host=server.url).show(card.id)
    assert "vision" in (shown.capabilities or [])


def test_bad_images_are_400s_and_the_server_serves_on(server: RunningServer) -> None:
    three = [{"type": "image_url", "image_url": {"url": data_url(
        encoded(picture(k), "PNG"), "PNG")}} for k in range(3)]
    with pytest.raises(openai.BadRequestError, match=r"At most 2 image\(s\) may be provided "
                       "in one prompt"):
        server.client().chat.completions.create(
            model=model_id(server), max_tokens=1, messages=[{"role": "user", "content": three}])
    truncated = data_url(encoded(picture(6), "PNG")[:200], "PNG")
    with pytest.raises(openai.BadRequestError, match="decoded"):
        openai_chat(server, truncated)
    huge = data_url(png_header(20_000, 20_000), "PNG")  # refused from its header
    with pytest.raises(openai.BadRequestError, match="pixels"):
        openai_chat(server, huge)
    text = "data:text/plain;base64," + base64.b64encode(b"hello").decode()
    with pytest.raises(openai.BadRequestError, match="media type"):
        openai_chat(server, text)
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="could not be decoded"):
        claude.messages.create(model=model_id(server), max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png",
                "data": base64.b64encode(b"not a png").decode()}}]}])
    assert openai_chat(server, data_url(encoded(picture(7), "PNG"), "PNG")).choices
    assert httpx.get(server.url + "/health").status_code == 200
    assert server.metric("nanoserve:num_requests_running") == 0  # nothing left behind


def test_the_prefix_cache_and_the_disk_key_on_the_pixels(server: RunningServer,
                                                         vlm_dir: Path, disk: Path) -> None:
    long_text = "Describe it in detail, please, " * 8
    first = data_url(encoded(picture(4), "PNG"), "PNG")
    other = data_url(encoded(picture(5), "PNG"), "PNG")
    cold = openai_chat(server, first, long_text)
    warm = openai_chat(server, first, long_text)
    missed = openai_chat(server, other, long_text)
    num_prompt = cold.usage.prompt_tokens
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= num_prompt - 4 and warm.choices[0].message.content == \
        cold.choices[0].message.content
    # the other image: the blocks before its placeholders, none from the first it touches
    ids = server.post("/v1/chat/completions/render", {
        "model": model_id(server), "messages": [{"role": "user", "content": [
            {"type": "text", "text": long_text},
            {"type": "image_url", "image_url": {"url": other}}]}]}).json()["token_ids"]
    assert missed.usage.prompt_tokens_details.cached_tokens == ids.index(IMAGE_ID) // 4 * 4
    restarted = RunningServer("--model", str(vlm_dir), "--block-size", "4",
                              "--kv-cache-disk", str(disk), wait=False)
    try:
        server.stop()  # its blocks written to the disk tier on the way out
        restarted.wait_healthy()
        again = openai_chat(restarted, first, long_text)
        assert again.usage.prompt_tokens_details.cached_tokens >= num_prompt - 4
        assert again.choices[0].message.content == cold.choices[0].message.content
    finally:
        restarted.stop()




def test_a_models_dir_serves_a_gguf_with_its_projector(vlm_dir: Path, tmp_path: Path) -> None:
    """llama-server's router layout: the model's subdirectory holds its text GGUF and its
    mmproj; the router's model server gets the projector and sees the image."""
    from vision_checkpoints import write_gemma3_mmproj, write_gemma3_text_gguf

    folder = tmp_path / "models" / "tiny-vision"
    folder.mkdir(parents=True)
    write_gemma3_text_gguf(folder / "tiny-gemma3-F32.gguf", vlm_dir)
    write_gemma3_mmproj(folder / "mmproj-tiny-gemma3-F16.gguf", vlm_dir)
    router = RunningServer("--models-dir", str(tmp_path / "models"))
    try:
        (card,) = router.client().models.list().data
        assert card.id == "tiny-vision"
        assert card.input_modalities == ["text", "image"]  # type: ignore[attr-defined]
        data = encoded(picture(1), "PNG")
        answer = router.client().chat.completions.create(
            model="tiny-vision", max_tokens=NUM_NEW, temperature=0,
            extra_body={"ignore_eos": True}, messages=[{"role": "user", "content": [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": data_url(data, "PNG")}}]}])
        ids = template_ids(vlm_dir, [{"type": "text", "text": QUESTION}, {"type": "image"}])
        assert answer.usage.prompt_tokens == len(ids)
        assert answer.choices[0].message.content == engine_text(vlm_dir, ids, [data])
        assert "vision" in (ollama.Client(host=router.url).show("tiny-vision").capabilities
                            or [])
    finally:
        router.stop()

"""Images through the engine equal transformers: a tiny random Gemma 3 with its vision tower
(tests/model/vision_checkpoints.py) gives transformers' prompt logits with one and with two
images (the placeholders attending each other both ways, no embedding scale on their rows),
and its greedy tokens alone, batched, in chunks of every size around and inside an image, and
after preemption; the prefix cache and the encoder cache key on the pixels."""

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
from vision_checkpoints import BOI_ID, EOI_ID, IMAGE_ID, TOKENS_PER_IMAGE

from nanoserve.engine.core import EngineCore
from nanoserve.engine.kv_cache import image_keys
from nanoserve.engine.scheduler import whole_images
from nanoserve.model.vision.gemma3_images import Gemma3ImageProcessor
from nanoserve.protocol import ImageInput
from nanoserve.sampling_params import SamplingParams

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    from vision_checkpoints import write_tiny_gemma3_vlm

    return write_tiny_gemma3_vlm(tmp_path_factory.mktemp("tiny-gemma3-vlm"), default_tokenizer)


@pytest.fixture(scope="module")
def reference(vlm_dir: Path) -> Any:
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(
        vlm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(vlm_dir: Path, default_tokenizer: Any) -> Gemma3ImageProcessor:
    import transformers

    found = Gemma3ImageProcessor.from_hf_dir(
        vlm_dir, transformers.AutoTokenizer.from_pretrained(vlm_dir))
    assert found is not None
    return found


def picture(seed: int, size: tuple[int, int] = (50, 37)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size[::-1], 3),
                                                                dtype=np.uint8))


def image_prompt(num_images: int, text_len: int = 5, seed: int = 0) -> list[int]:
    """Text, then each image's block (<start_of_image>, its placeholders, <end_of_image>)
    followed by more text."""
    rng = np.random.default_rng(seed)
    ids = [1, *rng.integers(3, 40000, text_len).tolist()]
    for _ in range(num_images):
        ids += [BOI_ID, *[IMAGE_ID] * TOKENS_PER_IMAGE, EOI_ID,
                *rng.integers(3, 40000, text_len).tolist()]
    return ids


def image_inputs(processor: Gemma3ImageProcessor, ids: list[int],
                 images: list[Image.Image], seeds: list[int]) -> list[ImageInput]:
    starts = [i for i, t in enumerate(ids) if t == IMAGE_ID and ids[i - 1] != IMAGE_ID]
    return [ImageInput(start, TOKENS_PER_IMAGE, seed.to_bytes(16, "little"),
                       processor.resize(image))
            for start, image, seed in zip(starts, images, seeds, strict=True)]


@torch.inference_mode()
def hf_logits(reference: Any, processor: Gemma3ImageProcessor, ids: list[int],
              images: list[Image.Image]) -> torch.Tensor:
    """transformers' logits at every position, its own preprocessing and mask."""
    import transformers

    input_ids = torch.tensor([ids])
    if not images:
        return reference(input_ids=input_ids).logits[0].float()
    hf_processor = transformers.Gemma3ImageProcessorPil(
        size={"height": processor.image_size, "width": processor.image_size},
        image_mean=list(processor.image_mean), image_std=list(processor.image_std))
    pixels = hf_processor(images, return_tensors="pt")["pixel_values"]
    return reference(input_ids=input_ids, pixel_values=pixels,
                     token_type_ids=(input_ids == IMAGE_ID).long()).logits[0].float()


@torch.inference_mode()
def hf_greedy(reference: Any, processor: Gemma3ImageProcessor, ids: list[int],
              images: list[Image.Image]) -> list[int]:
    """Greedy tokens by recomputing the whole sequence each step (no cache to trust)."""
    tokens: list[int] = []
    for _ in range(NUM_NEW):
        tokens.append(int(hf_logits(reference, processor, ids + tokens, images)[-1].argmax()))
    return tokens


def engine_prompt_logits(engine: EngineCore, ids: list[int],
                         images: list[ImageInput]) -> torch.Tensor:
    """The logits of every prompt position through the engine's own step (prompt logprobs
    would give a few per position; the runner's rows give them all)."""
    rows: list[torch.Tensor] = []
    execute = engine.runner.execute_step

    def keep_hidden(step: Any) -> Any:
        logits, prompt_logits, hidden = execute(step)
        rows.append(engine.runner.compute_logits(hidden))
        return logits, prompt_logits, hidden

    engine.runner.execute_step = keep_hidden  # type: ignore[method-assign]
    try:
        engine.add_request("logits", ids, SamplingParams(temperature=0.0, max_tokens=1),
                           images=images)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.execute_step = execute  # type: ignore[method-assign]
    return torch.cat(rows)[: len(ids)]


@pytest.mark.parametrize("num_images", [1, 2])
def test_prompt_logits_equal_transformers(vlm_dir: Path, reference: Any,
                                          processor: Gemma3ImageProcessor,
                                          num_images: int) -> None:
    ids = image_prompt(num_images, text_len=7)
    pictures = [picture(s) for s in range(num_images)]
    theirs = hf_logits(reference, processor, ids, pictures)
    for backend_cache in ("auto", "float16"):  # float32 cache: the SDPA-free CPU kernel too
        engine = make_engine(vlm_dir, kv_cache_dtype=backend_cache)
        ours = engine_prompt_logits(engine, ids, image_inputs(processor, ids, pictures,
                                                              list(range(num_images))))
        error = (ours - theirs).abs().max().item()
        limit = 1e-4 if backend_cache == "auto" else 5e-2
        assert error < limit * theirs.abs().max().item(), f"{backend_cache}: {error:.2e}"


def test_the_mask_is_seen(vlm_dir: Path, reference: Any,
                          processor: Gemma3ImageProcessor) -> None:
    """Causal placeholders would give other logits: the test above can fail."""
    ids = image_prompt(1, text_len=7)
    pictures = [picture(0)]
    both_ways = hf_logits(reference, processor, ids, pictures)
    import transformers

    pixels = transformers.Gemma3ImageProcessorPil(
        size={"height": processor.image_size, "width": processor.image_size},
        image_mean=list(processor.image_mean), image_std=list(processor.image_std))(
        pictures, return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        causal = reference(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    assert (causal - both_ways).abs().max() > 1e-3


def test_greedy_tokens_alone_batched_chunked_preempted(vlm_dir: Path, reference: Any,
                                                       processor: Gemma3ImageProcessor) -> None:
    shapes = {"one": (1, 0), "two": (2, 1), "again": (1, 2), "text": (0, 3)}
    prompts = {rid: image_prompt(n, text_len=9 + seed, seed=seed)
               for rid, (n, seed) in shapes.items()}
    pictures = {rid: [picture(seed + k) for k in range(n)] for rid, (n, seed) in shapes.items()}
    expected = {rid: hf_greedy(reference, processor, ids, pictures[rid])
                for rid, ids in prompts.items()}
    inputs = {rid: image_inputs(processor, prompts[rid], pictures[rid],
                                [seed + k for k in range(n)])
              for rid, (n, seed) in shapes.items()}

    def run(engine: EngineCore) -> dict[str, list[int]]:
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, GREEDY, images=inputs[rid])
        out: dict[str, list[int]] = {rid: [] for rid in prompts}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        return out

    for rid in ("two", "text"):  # alone (the batches below hold the other two)
        ids = prompts[rid]
        engine = make_engine(vlm_dir)
        engine.add_request(rid, ids, GREEDY, images=inputs[rid])
        got: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                got.extend(o.new_token_ids)
        assert got == expected[rid], rid
    for budget in (5, 64):  # chunks that end before, inside and after images
        assert run(make_engine(vlm_dir, max_num_batched_tokens=budget)) == expected, budget
    # preempted and readmitted over its own cached blocks in both KV layer groups (windowed
    # and full): the text prompt lost a token here before each group's hits were held ahead
    # of any group's new blocks (kv_cache.py allocate_slots)
    small = make_engine(vlm_dir, num_blocks=36, block_size=8, max_num_batched_tokens=8,
                        max_model_len=64)
    assert run(small) == expected
    assert small.stats.num_preemptions > 0


def test_the_same_model_as_gguf_and_mmproj(vlm_dir: Path, processor: Gemma3ImageProcessor,
                                           tmp_path: Path) -> None:
    """The text half as llama.cpp's gemma3 GGUF (float32) and the tower as its mmproj: the
    API side renders the same ids, the engine gives the same tokens."""
    from vision_checkpoints import write_gemma3_mmproj, write_gemma3_text_gguf

    from nanoserve.model.frontend import load_frontend

    text = write_gemma3_text_gguf(tmp_path / "tiny-gemma3.gguf", vlm_dir)
    mmproj = write_gemma3_mmproj(tmp_path / "mmproj-tiny-gemma3.gguf", vlm_dir)
    frontends = [load_frontend(str(vlm_dir)), load_frontend(str(text), str(mmproj))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"},
                                             {"type": "image"}]}]
    rendered = []
    for frontend in frontends:
        assert frontend.image_processor is not None
        prompt = frontend.tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True)
        rendered.append(frontend.tokenizer.encode(
            frontend.image_processor.expand_prompt(prompt), add_special_tokens=False))
    assert rendered[0] == rendered[1] and rendered[0].count(IMAGE_ID) == 2 * TOKENS_PER_IMAGE
    ids = rendered[0]
    inputs = image_inputs(processor, ids, [picture(8), picture(9)], [8, 9])
    outputs = []
    for engine in (make_engine(vlm_dir), make_engine(text, mmproj=mmproj)):
        engine.add_request("r", ids, GREEDY, images=inputs)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        outputs.append(tokens)
    assert outputs[0] == outputs[1] and len(outputs[0]) == NUM_NEW


def test_prefix_cache_keys_on_the_pixels(vlm_dir: Path, processor: Gemma3ImageProcessor
                                         ) -> None:
    engine = make_engine(vlm_dir, block_size=4)
    ids = image_prompt(1, text_len=9)
    first = image_inputs(processor, ids, [picture(0)], [0])
    other = image_inputs(processor, ids, [picture(1)], [1])

    def cached(rid: str, images: list[ImageInput]) -> tuple[int, list[int]]:
        engine.add_request(rid, ids, GREEDY, images=images)
        tokens, num_cached = [], 0
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids
                num_cached = max(num_cached, o.num_cached_tokens)
        return num_cached, tokens

    cold, tokens = cached("a", first)
    assert cold == 0
    warm, again = cached("b", first)
    assert warm >= len(ids) - 4 and again == tokens  # the same image: every full block
    encoder = engine.runner.image_encoder
    assert encoder is not None and encoder.num_encoded == 1  # the tower ran once
    miss, _ = cached("c", other)  # the same text, other pixels: only the blocks before them
    assert miss == first[0].offset // 4 * 4
    assert encoder.num_encoded == 2


def test_image_keys_name_the_image_and_its_offset() -> None:
    image = ImageInput(6, 4, b"a" * 16, np.zeros((1, 1, 3), np.uint8))
    assert image_keys([image], 0, 4) == b""
    assert image_keys([image], 4, 8) != image_keys([image], 8, 12)
    moved = ImageInput(7, 4, b"a" * 16, image.pixels)
    assert image_keys([moved], 4, 8) != image_keys([image], 4, 8)


def test_a_chunk_never_splits_an_image(vlm_dir: Path) -> None:
    from nanoserve.engine.request import Request

    request = Request("r", [0] * 20, GREEDY)
    request.images = [ImageInput(6, 4, b"a" * 16, np.zeros((1, 1, 3), np.uint8))]
    assert whole_images(request, 0, 8, 8) == 6  # cut before the image
    assert whole_images(request, 0, 12, 12) == 12  # past it
    assert whole_images(request, 8, 1, 8) == 2  # a hit ended inside: to its end
    assert whole_images(request, 8, 1, 1) == 0  # no room for the rest: wait
    engine = make_engine(vlm_dir)
    with pytest.raises(ValueError, match="does not fit one step's token budget"):
        engine = make_engine(vlm_dir, max_num_batched_tokens=3)
        engine.add_request("big", image_prompt(1), GREEDY,
                           images=[ImageInput(7, 4, b"a" * 16, np.zeros((64, 64, 3), np.uint8))])


def test_a_text_model_refuses_images(tiny_model_dir: Any) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match=r"At most 0 image\(s\)"):
        engine.add_request("r", [1, 2, 3, 4], GREEDY,
                           images=[ImageInput(1, 2, b"a" * 16, np.zeros((1, 1, 3), np.uint8))])


def test_an_image_crosses_the_process_boundary_whole() -> None:
    """A uint8 array's dtype str is "|u1": it once broke the array header's separator."""
    from nanoserve.protocol import EngineRequest, decode_input, encode

    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    sent = EngineRequest("r", [1, 2, 3], GREEDY, 0,
                         images=[ImageInput(1, 2, b"h" * 16, pixels)])
    got = decode_input(encode(sent))
    assert isinstance(got, EngineRequest)
    assert got.images[0].content_hash == b"h" * 16
    assert np.array_equal(got.images[0].pixels, pixels)
    assert got.images[0].pixels.dtype == np.uint8

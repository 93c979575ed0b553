"""A prompt's images made the engine's: each decoded image (serving/images.py) resized by the
model's image processor and tied to its run of placeholder tokens in the prompt's ids.

The chat template writes one image marker per image part (Gemma 3's `<start_of_image>`); the
processor expands each into the model's placeholder sequence before the prompt is tokenized,
as transformers' processor does, so the ids equal transformers'. Here the runs of placeholder
ids are found in the ids and matched, in order, to the request's images.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.images import DecodedImage
from nanoserve.protocol import ImageInput


class PromptIds(list[int]):
    """A prompt's token ids, and the images whose placeholders they hold (in prompt order):
    what the engine client sends as one EngineRequest."""

    images: tuple[ImageInput, ...] = ()

    @classmethod
    def with_images(cls, ids: Sequence[int], images: Sequence[ImageInput]) -> PromptIds:
        out = cls(ids)
        out.images = tuple(images)
        return out


def placeholder_runs(ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """The (offset, length) of every run of `token_id` in `ids`, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate([*ids, -1]):
        if token == token_id and start is None:
            start = i
        elif token != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def image_token_counts(processor: Any, images: Sequence[DecodedImage]) -> list[int]:
    """Each image's placeholder tokens (Qwen3.5's depend on its size); a 400 naming the part
    for an image the model does not take (Qwen3.5: more elongated than 200:1)."""
    counts = []
    for image in images:
        try:
            counts.append(processor.num_tokens(image.image.height, image.image.width))
        except ValueError as e:
            raise bad_request(f"{image.where}: {e}", image.where) from None
    return counts


def expand_images(processor: Any, prompt: str, counts: Sequence[int]) -> str:
    """The rendered prompt with each image marker expanded to its placeholders; a 400 where
    the template wrote another number of markers than the request has images."""
    try:
        return str(processor.expand_prompt(prompt, counts))
    except ValueError as e:
        raise bad_request(f"the chat template's images do not match the request's: {e}",
                          "messages") from None


async def place_images(processor: Any, images: Sequence[DecodedImage], ids: Sequence[int],
                       counts: Sequence[int]) -> PromptIds:
    """`ids` with `images` tied to their placeholder runs (`counts` tokens each), their
    pixels resized by `processor` (off the event loop: ~60-80 ms an image at 896x896). A
    template that wrote another number of image markers than the request has images is a
    400."""
    runs = placeholder_runs(ids, processor.image_token_id)
    if [n for _, n in runs] != list(counts):
        raise bad_request(
            f"the chat template placed {len(runs)} image(s) in the prompt for the request's "
            f"{len(images)}; every image part must reach the template (a model's template "
            "may drop images from some roles)", "messages")
    pixels = await asyncio.gather(*(asyncio.to_thread(processor.resize, image.image)
                                    for image in images))
    return PromptIds.with_images(ids, [
        ImageInput(offset, length, image.content_hash, resized, image_grid(processor, resized))
        for (offset, length), image, resized in zip(runs, images, pixels, strict=True)])


def image_grid(processor: Any, pixels: Any) -> tuple[int, int, int]:
    """The image's (t, h, w) in patches where the model's positions are 3-D (Qwen3.5's
    processor has a merge size), else (1, 1, 1)."""
    if not hasattr(processor, "merge_size"):
        return (1, 1, 1)
    patch = processor.patch_size
    return (1, pixels.shape[0] // patch, pixels.shape[1] // patch)

"""A request's images, checked and attached when the engine core adds it: the model must see
(a vision tower), each image's placeholders lie apart inside the prompt and fit one step (an
image is computed whole), and where the model's RoPE is multimodal (Qwen3.5) the prompt's
(t, h, w) positions are computed once (engine/rope_positions.py)."""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.engine.request import Request
from nanoserve.engine.rope_positions import prompt_rope_positions
from nanoserve.model.loader import ModelInfo
from nanoserve.protocol import ImageInput


def attach_images(request: Request, images: Sequence[ImageInput], model: ModelInfo,
                  step_budget: int) -> None:
    """`images` onto `request` (its prompt's placeholder spans); a ValueError, in words the
    API would use, for images this model cannot see or no step could compute whole."""
    if not model.has_vision:
        raise ValueError(f"At most 0 image(s) may be provided in one prompt. "
                         f"{model.name} does not support image input")
    num_prompt_tokens = request.num_prompt_tokens
    end = 0
    for image in images:
        if image.offset < end or image.end > num_prompt_tokens or image.length < 1:
            raise ValueError(f"image placeholders [{image.offset}, {image.end}) overlap "
                             f"another image or lie outside the {num_prompt_tokens}-token "
                             "prompt")
        if image.length > step_budget:
            raise ValueError(f"an image of {image.length} tokens does not fit one step's "
                             f"token budget (--max-num-batched-tokens {step_budget}), and an "
                             "image is computed in one step")
        end = image.end
    request.images = list(images)
    if model.arch.mrope_section:  # Qwen3.5: its tokens' 3-D positions
        request.rope_positions, request.rope_delta = prompt_rope_positions(
            request.prompt_token_ids, images)

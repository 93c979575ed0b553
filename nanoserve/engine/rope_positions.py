"""Multimodal RoPE in the engine (Qwen3.5): each request's (t, h, w) positions, computed once
when it is added, and each step's rows of them.

A prompt's image placeholders turn at 3-D positions and the text after an image continues
from the image's start + max(h, w) / merge, not from its index (model/vision/mrope.py, equal
to transformers' get_rope_index); after the prompt, token i turns at i + the request's
`rope_delta` on all three axes. A request without images keeps 1-D positions (its rows are
its indexes on every axis).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from nanoserve.model.vision.mrope import mrope_positions
from nanoserve.protocol import ImageInput


def prompt_rope_positions(prompt_token_ids: Sequence[int], images: Sequence[ImageInput]
                          ) -> tuple[np.ndarray, int]:
    """The prompt's positions [3, P] int64 and its rope delta, from its images' placeholder
    runs and grids (merge = sqrt(patches / placeholders))."""
    first = images[0]
    t, h, w = first.grid
    merge = math.isqrt(t * h * w // first.length)
    return mrope_positions(prompt_token_ids, prompt_token_ids[first.offset],
                           [image.grid for image in images], merge)


def step_rope_positions(rows: Sequence[tuple[int, int, np.ndarray | None, int, int]],
                        num_tokens: int) -> np.ndarray:
    """The step's positions [3, T] int64 from each scheduled request's (first row, first
    index, its prompt's positions or None, its rope delta, its row count): a prompt token's
    own triple, a later token's index + delta, a request without images' its index."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    for first_row, start, prompt, delta, count in rows:
        index = np.arange(start, start + count)
        out[:, first_row : first_row + count] = index + delta
        if prompt is not None:
            in_prompt = index < prompt.shape[1]
            out[:, first_row : first_row + count][:, in_prompt] = prompt[:, index[in_prompt]]
    return out

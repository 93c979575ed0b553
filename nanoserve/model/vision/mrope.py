"""Qwen3.5's 3-D M-RoPE positions of a prompt with images, as transformers'
`Qwen3_5Model.get_rope_index` computes them (numpy only: the engine computes them once per
request, before any step).

Each position is a (temporal, height, width) triple. A text token's three are equal and one
past the previous token's greatest; an image's tokens (its grid (t, h, w) in patches becomes
t x h/m x w/m tokens for merge m, in row-major order) sit at (start + frame, start + row,
start + column), with `start` the position the image's first token would have as text, and
the text after it resumes at start + max(h, w) / m. A position is then no longer the token's
index: after the prompt, token i (prompt or generated) takes position i + `rope_delta` on all
three axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(input_ids: Sequence[int] | np.ndarray, image_token_id: int,
                    grids: Sequence[tuple[int, int, int]],
                    merge_size: int) -> tuple[np.ndarray, int]:
    """(positions int64 [3, T], rope_delta) of the prompt `input_ids` [T] whose runs of
    `image_token_id` are the images of `grids` (each (t, h, w) in patches, in prompt order,
    t * h * w / merge_size^2 tokens each), equal to `get_rope_index(input_ids,
    mm_token_type_ids=(input_ids == image_token_id), image_grid_thw=grids)` for one sequence
    whose images are separated by text (the chat template wraps each in <|vision_start|>
    ... <|vision_end|>). rope_delta = max(positions) + 1 - T (0 without images). A
    ValueError when the image tokens and the grids disagree."""
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    starts = np.flatnonzero(ids == image_token_id)
    counts = [t * h * w // merge_size ** 2 for t, h, w in grids]
    if len(starts) != sum(counts):
        raise ValueError(f"the prompt has {len(starts)} image tokens (id {image_token_id}) "
                         f"where its {len(grids)} image grid(s) make {sum(counts)}")
    pieces: list[np.ndarray] = []
    position = 0  # the next text token's position
    index = 0  # the next token's index in `ids`
    for (t, h, w), count in zip(grids, counts, strict=True):
        start = int(starts[np.searchsorted(starts, index)])
        if not (ids[start:start + count] == image_token_id).all():
            raise ValueError(f"the image at token {start} has fewer than the {count} "
                             f"consecutive image tokens its grid {(t, h, w)} makes")
        pieces.append(_text(position, start - index))
        position += start - index
        pieces.append(_image(position, t, h // merge_size, w // merge_size))
        position += max(h, w) // merge_size
        index = start + count
    pieces.append(_text(position, len(ids) - index))
    positions = np.concatenate(pieces, axis=1)
    rope_delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, rope_delta


def _text(position: int, length: int) -> np.ndarray:
    """[3, length]: consecutive positions from `position`, equal on the three axes."""
    return np.broadcast_to(np.arange(position, position + length, dtype=np.int64),
                           (3, length))


def _image(start: int, frames: int, rows: int, columns: int) -> np.ndarray:
    """[3, frames * rows * columns]: (start + frame, start + row, start + column),
    row-major over (frame, row, column)."""
    grid = np.indices((frames, rows, columns), dtype=np.int64).reshape(3, -1)
    return grid + start

"""What both image processors read from a checkpoint the same way: a tokenizer's vocabulary
and per-channel triples (numpy-free, torch-free: the API process imports it)."""

from __future__ import annotations

from typing import Any


def vocabulary(tokenizer: Any) -> dict[str, int]:
    """Token text -> id, added tokens included (a transformers tokenizer or the engine's)."""
    return dict(tokenizer.get_vocab())


def triple(values: Any) -> tuple[float, float, float]:
    """Three floats from a list of three (or one float for all three channels)."""
    if isinstance(values, int | float):
        return (float(values),) * 3
    first, second, third = (float(value) for value in values)
    return (first, second, third)

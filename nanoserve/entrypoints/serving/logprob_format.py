"""Logprobs as OpenAI's responses write them: -inf clamped to its stand-in, a token's UTF-8
bytes, and the top alternatives of one position in rank order."""

from __future__ import annotations

import math

from nanoserve.outputs import Logprob, PositionLogprobs

MIN_LOGPROB = -9999.0  # OpenAI's stand-in for -inf


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isinf(value) or value < MIN_LOGPROB else value


def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chosen(position: PositionLogprobs, token_id: int) -> Logprob:
    return position[token_id]


def top_entries(position: PositionLogprobs, count: int) -> list[tuple[int, Logprob]]:
    """The top `count` alternatives, best first (the chosen token only where it ranks)."""
    ranked = sorted(((t, lp) for t, lp in position.items() if lp.rank is not None),
                    key=lambda item: item[1].rank or 0)
    out: list[tuple[int, Logprob]] = []
    for token_id, lp in ranked:
        if lp.rank is not None and lp.rank <= count and all(t != token_id for t, _ in out):
            out.append((token_id, lp))
    return out[:count]

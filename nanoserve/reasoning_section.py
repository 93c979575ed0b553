"""A model's reasoning section (`<think>…</think>`), as the parts below the entry points see it.

The sampler's thinking budget, the grammar that starts where reasoning ends (`structured/`) and
the output path's cut of a forced call list (`output/repeats.py`) each need to know where a
sample's reasoning ends; the tags' ids and texts, and where an answer begins in an output's
text, live here once. The text rule is the reasoning parsers' (`parsers/reasoning.py`): a
sample has at most one section, at its start, closed by its first `</think>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

START_TAG = "<think>"
END_TAG = "</think>"

# How a sample's output begins, for a grammar that starts where reasoning ends
# (`StructuredOutputsParams.after_reasoning`):
ReasoningStart = Literal["inside", "opening"]
INSIDE: ReasoningStart = "inside"  # the template opened the section: the answer follows `</think>`
OPENING: ReasoningStart = "opening"  # a first `<think>` opens it; any other start is the answer
STARTS: tuple[ReasoningStart, ...] = (INSIDE, OPENING)


@dataclass(frozen=True)
class ReasoningTokens:
    """The token ids that open and close a model's reasoning section (`<think>`, `</think>`)."""

    start: int
    end: int

    @classmethod
    def of(cls, tokenizer: Any) -> ReasoningTokens | None:
        """`<think>` / `</think>` when the vocabulary has each as one token (Qwen3, R1)."""
        vocab = tokenizer.get_vocab()
        start, end = vocab.get(START_TAG), vocab.get(END_TAG)
        return cls(start, end) if start is not None and end is not None else None


def answer_start(text: str, starts: str) -> int | None:
    """Where the answer begins in a sample's output `text` (an index into it), or None while
    the text is still reasoning or could still open a section. `starts`: one of `STARTS`."""
    if starts == OPENING:
        body = text.lstrip()
        if not body.startswith(START_TAG):
            return None if START_TAG.startswith(body) else 0
    at = text.find(END_TAG)
    return None if at == -1 else at + len(END_TAG)

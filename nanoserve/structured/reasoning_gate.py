"""A grammar that starts where the reasoning ends: a sequence's matcher behind a gate that lets
the reasoning section through as free text (vLLM's structured outputs with a reasoning parser).

The gate has three phases. "opening": the output's first token may be `<think>` (then
"inside") or the answer's first token, which the grammar takes (then "answering"); its mask is
the grammar's plus `<think>`. "inside": every token but end-of-sequence is allowed (an answer
was asked for, so the sample cannot end before it), and `</think>` moves to "answering", the
grammar's first token being the one after it. "answering": the grammar alone, as without a
gate. The phases follow the reasoning parsers' split (`parsers/reasoning.py`), so what the
grammar constrains is exactly what the client gets as content. The thinking budget
(`sample/stages.py`), which comes after the mask, still forces `</think>` inside the section.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nanoserve.structured.bitmask import BITS_PER_WORD
from nanoserve.structured.grammar import GrammarMatcher

OPENING, INSIDE, ANSWERING = "opening", "inside", "answering"


class ReasoningGatedMatcher:
    """A `GrammarMatcher`'s interface (fill a mask row, accept, copy, is_terminated, error)
    over one sequence's matcher, which sees only the tokens after the reasoning section."""

    def __init__(self, matcher: GrammarMatcher, phase: str, start_id: int, end_id: int,
                 eos_token_ids: Sequence[int]) -> None:
        """`phase`: OPENING or INSIDE, how the output begins (`StructuredOutputsParams.
        after_reasoning`); `start_id`/`end_id`: the `<think>`/`</think>` tokens."""
        self.matcher = matcher
        self.phase = phase
        self.start_id = start_id
        self.end_id = end_id
        self.eos_token_ids = tuple(eos_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this phase's allowed next tokens into `bitmask[row]` (see the module)."""
        if self.phase == INSIDE:
            bitmask[row].fill_(-1)
            for token in self.eos_token_ids:
                _set_bit(bitmask, row, token, False)
            return
        self.matcher.fill_bitmask(bitmask, row)
        if self.phase == OPENING:
            _set_bit(bitmask, row, self.start_id, True)

    def accept(self, token_id: int) -> bool:
        """Advance by a drawn token; False if the phase's grammar forbids it."""
        if self.phase == INSIDE:
            if token_id in self.eos_token_ids:
                return False
            if token_id == self.end_id:
                self.phase = ANSWERING
            return True
        if self.phase == OPENING:
            if token_id == self.start_id:
                self.phase = INSIDE
                return True
            self.phase = ANSWERING
        return self.matcher.accept(token_id)

    def copy(self) -> ReasoningGatedMatcher:
        return ReasoningGatedMatcher(self.matcher.copy(), self.phase, self.start_id,
                                     self.end_id, self.eos_token_ids)

    def is_terminated(self) -> bool:
        """True once the answer's grammar is complete (never inside the reasoning)."""
        return self.phase == ANSWERING and self.matcher.is_terminated()

    @property
    def error(self) -> str:
        if self.phase == INSIDE:
            return "end of sequence inside the reasoning section, before the answer"
        return self.matcher.error


def _set_bit(bitmask: torch.Tensor, row: int, token: int, allowed: bool) -> None:
    """Allow or forbid one token in a mask row (a token past the row's width is left)."""
    word, bit = divmod(token, BITS_PER_WORD)
    if word >= bitmask.shape[1]:
        return
    value = int(bitmask[row, word]) & 0xFFFFFFFF
    value = value | (1 << bit) if allowed else value & ~(1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # as int32

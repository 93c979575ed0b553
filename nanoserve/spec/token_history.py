"""A proposer's view of one sequence's tokens (prompt + committed output), kept per sampler
slot and extended with the tokens committed since the last call, never rebuilt per step.

A slot is reused once its request ends; the engine's output list is the request's own object
(`SequenceData.output_token_ids`, appended in place), so a different list in the slot means a
new request, and its history starts again."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from nanoserve.sample.sequence import SequenceData

Index = TypeVar("Index", bound="TokenIndex")


class TokenIndex:
    """What a proposer keeps of one sequence; `extend` sees every token once, in order."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)


class SlotIndexes(Generic[Index]):
    """One index per sampler slot, brought up to date with each call."""

    def __init__(self, make: Callable[[], Index]) -> None:
        self.make = make
        self.by_slot: dict[int, tuple[Sequence[int], Index]] = {}

    def current(self, seq: SequenceData) -> Index:
        entry = self.by_slot.get(seq.slot)
        if entry is None or entry[0] is not seq.output_token_ids:
            index = self.make()
            index.extend(seq.prompt_token_ids)
            self.by_slot[seq.slot] = (seq.output_token_ids, index)
        else:
            index = entry[1]
        seen = len(index.tokens) - len(seq.prompt_token_ids)
        if seen < len(seq.output_token_ids):
            index.extend(seq.output_token_ids[seen:])
        return index

"""Prompt lookup ("ngram", vLLM's name): the longest n-gram, n in [min_n, max_n], that ends the
sequence and occurred before; the draft is the tokens that followed its most recent occurrence.

Per sequence one dict per n maps an n-gram to the position after its latest occurrence, updated
with each committed token (O(max_n) per token, O(1) per lookup), where vLLM scans the whole
context each step (KMP, earliest occurrence). The most recent occurrence is llama.cpp's
`ngram-simple` choice: in an edited copy it is the place being copied from.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.sample.sequence import SequenceData
from nanoserve.spec.token_history import SlotIndexes, TokenIndex


class NgramIndex(TokenIndex):
    """n-gram -> the position of the token that followed its latest occurrence, per n."""

    def __init__(self, min_n: int, max_n: int) -> None:
        super().__init__()
        self.min_n, self.max_n = min_n, max_n
        self.next_position: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the new token's position
            for n, table in self.next_position.items():
                if end >= n:  # the n-gram just before the new token is followed by it
                    table[tuple(self.tokens[end - n:end])] = end

    def propose(self, num_tokens: int) -> list[int]:
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.next_position[n].get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return tokens[start:start + num_tokens]
        return []


class NgramProposer:
    """Prompt lookup over a sequence's committed tokens (`--speculative-config
    '{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 5}'`)."""

    def __init__(self, prompt_lookup_min: int = 3, prompt_lookup_max: int = 5) -> None:
        self.indexes = SlotIndexes(lambda: NgramIndex(prompt_lookup_min, prompt_lookup_max))

    def propose(self, seq: SequenceData, num_tokens: int) -> Sequence[int]:
        return self.indexes.current(seq).propose(num_tokens)

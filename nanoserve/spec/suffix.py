"""Suffix decoding ("suffix", vLLM's name, after Arctic's SuffixDecoding): the drafts follow the
longest earlier match of the sequence's suffix (up to `max_tree_depth` tokens), scored by how
often each continuation followed it, and grow only while that score holds.

Per sequence a dict maps each bigram to the positions that followed its occurrences (one entry
per committed token). A step takes the latest `MAX_CANDIDATES` occurrences of the last bigram,
extends each match backwards to the longest, keeps those that match longest, and walks forward:
at each draft position the most frequent next token among the kept occurrences, its share
multiplied into the draft's score; the draft stops when the score falls under
`min_token_prob`, or at `max_spec_factor` times the match length (long matches earn long
drafts, a two-token match a short one). The defaults are vLLM's (depth 24, factor 1.0, 0.1).

Arctic's index is a suffix tree over the prompt and every past output, in C++; a tree per
request with 24 levels would cost ~24 Python dict nodes a token (~40 MB at 8k tokens), so the
match is found on the committed tokens themselves. The cross-request index of past outputs is
not built yet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from nanoserve.sample.sequence import SequenceData
from nanoserve.spec.token_history import SlotIndexes, TokenIndex

MAX_CANDIDATES = 64  # latest occurrences of the last bigram looked at per step


class SuffixIndex(TokenIndex):
    """Bigram -> the positions of the tokens that followed it, oldest first."""

    def __init__(self) -> None:
        super().__init__()
        self.followers: dict[tuple[int, int], list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            if end >= 2:
                key = (self.tokens[end - 2], self.tokens[end - 1])
                self.followers.setdefault(key, []).append(end)

    def longest_matches(self, max_depth: int) -> tuple[list[int], int]:
        """The positions after the earlier occurrences that match the suffix longest, and
        that length (0 when the last bigram never occurred before)."""
        tokens = self.tokens
        if len(tokens) < 2:
            return [], 0
        positions = self.followers.get((tokens[-2], tokens[-1]))
        if not positions:
            return [], 0
        best: list[int] = []
        best_length = 0
        end = len(tokens)
        for position in positions[-MAX_CANDIDATES:]:
            length = 2
            while (length < max_depth and position - length - 1 >= 0
                   and tokens[position - length - 1] == tokens[end - length - 1]):
                length += 1
            if length > best_length:
                best, best_length = [position], length
            elif length == best_length:
                best.append(position)
        return best, best_length

    def propose(self, num_tokens: int, max_depth: int, max_spec_factor: float,
                min_token_prob: float) -> list[int]:
        matches, length = self.longest_matches(max_depth)
        limit = min(num_tokens, int(max_spec_factor * length))
        draft: list[int] = []
        score = 1.0
        tokens = self.tokens
        while matches and len(draft) < limit:
            counts = Counter(tokens[p] for p in matches if p < len(tokens))
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            score *= count / len(matches)
            if score < min_token_prob:
                break
            draft.append(token)
            matches = [p + 1 for p in matches if p < len(tokens) and tokens[p] == token]
        return draft


class SuffixProposer:
    """`--speculative-config '{"method": "suffix", "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1}'`"""

    def __init__(self, suffix_decoding_max_tree_depth: int = 24,
                 suffix_decoding_max_spec_factor: float = 1.0,
                 suffix_decoding_min_token_prob: float = 0.1) -> None:
        self.max_depth = suffix_decoding_max_tree_depth
        self.max_spec_factor = suffix_decoding_max_spec_factor
        self.min_token_prob = suffix_decoding_min_token_prob
        self.indexes = SlotIndexes(SuffixIndex)

    def propose(self, seq: SequenceData, num_tokens: int) -> Sequence[int]:
        return self.indexes.current(seq).propose(num_tokens, self.max_depth,
                                                 self.max_spec_factor, self.min_token_prob)

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
match is found on the committed tokens themselves.

Past outputs (`suffix_decoding_max_cached_requests`, vLLM's name; 0, the default here, turns
them off): the outputs of the last N finished requests are kept in one more such index per
tenant, one stream with a separator between outputs, and a request's suffix is matched there
too; the longer draft wins. A tenant is the API key a request presented (its digest), so what
one client's past outputs do to another's speed (its acceptance, hence its timing) stays within
that key. Drafts change no token in any case.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from nanoserve.sample.sequence import SequenceData
from nanoserve.spec.token_history import SlotIndexes, TokenIndex

MAX_CANDIDATES = 64  # latest occurrences of the last bigram looked at per step
SEPARATOR = -1  # between past outputs in their stream: never equal to a token, so no match
# crosses from one output into the next


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

    def longest_matches(self, max_depth: int, query: Sequence[int] | None = None
                        ) -> tuple[list[int], int]:
        """The positions after the earlier occurrences that match the suffix of `query` (by
        default this index's own tokens) longest, and that length (0 when its last bigram
        never occurred)."""
        tokens = self.tokens
        query = tokens if query is None else query
        if len(query) < 2:
            return [], 0
        positions = self.followers.get((query[-2], query[-1]))
        if not positions:
            return [], 0
        best: list[int] = []
        best_length = 0
        end = len(query)
        for position in positions[-MAX_CANDIDATES:]:
            length = 2
            while (length < max_depth and position - length - 1 >= 0 and end - length - 1 >= 0
                   and tokens[position - length - 1] == query[end - length - 1]):
                length += 1
            if length > best_length:
                best, best_length = [position], length
            elif length == best_length:
                best.append(position)
        return best, best_length

    def propose(self, num_tokens: int, max_depth: int, max_spec_factor: float,
                min_token_prob: float, query: Sequence[int] | None = None) -> list[int]:
        """Up to `num_tokens` tokens to follow `query` (by default this index's own tokens),
        from what followed its longest matches here."""
        matches, length = self.longest_matches(max_depth, query)
        limit = min(num_tokens, int(max_spec_factor * length))
        draft: list[int] = []
        score = 1.0
        tokens = self.tokens
        while matches and len(draft) < limit:
            counts = Counter(tokens[p] for p in matches
                             if p < len(tokens) and tokens[p] != SEPARATOR)
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            score *= count / len(matches)
            if score < min_token_prob:
                break
            draft.append(token)
            matches = [p + 1 for p in matches if p < len(tokens) and tokens[p] == token]
        return draft


class PastOutputs:
    """One tenant's last `max_requests` finished outputs, as one suffix index."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.outputs: deque[list[int]] = deque()
        self.index = SuffixIndex()

    def add(self, output: Sequence[int]) -> None:
        self.outputs.append(list(output))
        if len(self.outputs) > self.max_requests + self.max_requests // 2:
            # drop the oldest and rebuild, once per max_requests / 2 outputs (amortized)
            while len(self.outputs) > self.max_requests:
                self.outputs.popleft()
            self.index = SuffixIndex()
            for kept in self.outputs:
                self._extend(kept)
        else:
            self._extend(self.outputs[-1])

    def _extend(self, output: list[int]) -> None:
        self.index.extend([*output, SEPARATOR])


class SuffixProposer:
    """`--speculative-config '{"method": "suffix", "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1,
    "suffix_decoding_max_cached_requests": 0}'`"""

    def __init__(self, suffix_decoding_max_tree_depth: int = 24,
                 suffix_decoding_max_spec_factor: float = 1.0,
                 suffix_decoding_min_token_prob: float = 0.1,
                 suffix_decoding_max_cached_requests: int = 0) -> None:
        self.max_depth = suffix_decoding_max_tree_depth
        self.max_spec_factor = suffix_decoding_max_spec_factor
        self.min_token_prob = suffix_decoding_min_token_prob
        self.max_cached_requests = suffix_decoding_max_cached_requests
        self.indexes = SlotIndexes(SuffixIndex)
        self.past: dict[str, PastOutputs] = {}  # by tenant

    def propose(self, seq: SequenceData, num_tokens: int) -> Sequence[int]:
        index = self.indexes.current(seq)
        settings = (num_tokens, self.max_depth, self.max_spec_factor, self.min_token_prob)
        draft = index.propose(*settings)
        past = self.past.get(seq.tenant)
        if past is not None and len(draft) < num_tokens:
            from_past = past.index.propose(*settings, query=index.tokens)
            if len(from_past) > len(draft):
                draft = from_past
        return draft

    def request_finished(self, seq: SequenceData) -> None:
        """Keep a finished request's output for its tenant's later requests (when on)."""
        if self.max_cached_requests and seq.output_token_ids:
            past = self.past.get(seq.tenant)
            if past is None:
                past = self.past[seq.tenant] = PastOutputs(self.max_cached_requests)
            past.add(seq.output_token_ids)

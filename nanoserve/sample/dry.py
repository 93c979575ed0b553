"""DRY ("Don't Repeat Yourself"), llama.cpp's repetition penalty over repeated sequences.

For each row whose request sets `dry_multiplier` > 0, llama.cpp's `llama_sampler_dry_apply`
over the row's history: its last `dry_penalty_last_n` tokens (-1: all) of prompt and output,
as llama-server feeds every prompt token to its sampler chain before the first draw; a draft
row's history ends with its pending drafts, so it is penalized as a one-token decode after them.
Nothing is kept between steps: each row's history is read afresh.

1. The repeat limit: the tokens after the latest sequence breaker in the history (a head
   token followed by its tail; of several tails, the longest that matches), or the whole
   history without one. Under `dry_allowed_length`, nothing is penalized.
2. For each position e but the last, the length of the longest suffix of history[:e+1] that is
   also a suffix of the history, capped at the limit (llama.cpp's reverse Z-algorithm).
3. Where that length is >= `dry_allowed_length`, the token after e, history[e+1], would extend
   a repeat: it takes the longest such length L of any position.
4. Each such token but a single-token breaker: logit -= multiplier * base^(L - allowed_length),
   the exponent clamped to int(88.7228391 / log(base)) when base > 1.000001 (float32), the
   power and product in float64 (C++'s `std::pow(float, int)`), rounded to float32, then
   subtracted in float32.

Step 2 gallops: the positions that match the last token extend together in numpy, a block of
tokens a round, the block doubling each round, only up to the length past which the penalty no
longer grows (allowed_length + the clamp). Where many long matches make the rounds cost more
than prefix doubling (`_ROUND_COST`, `_TOKEN_COST`, `_SORT_COST`: a one-token loop, a low base),
exact prefix doubling over the reversed history finishes the row in O(n log cap) numpy calls
(llama.cpp's Z algorithm in Python, `_reverse_z`, the previous fallback and now the tests'
reference, is O(n) but ~0.6 us a token). `dry_penalties` per row at 4,096 tokens, 2 shared
cores, Z fallback -> this: text looped with a 63-token period, 0.57 -> 0.17 ms at base 1.75 and
2.4 -> 1.3 ms at base 1.1 (the clamp past the history); a one-token loop 2.8 -> 0.9 ms; random
tokens 0.02 ms either way.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.sample.penalty_window import history_tail
from nanoserve.sample.sequence import SequenceData
from nanoserve.sample.stages import SamplingBatch
from nanoserve.sample.state import SamplingState

FLOAT_MAX_LOG = np.float32(88.7228391)  # llama.cpp's clamp: log(FLT_MAX), roughly
# Step 2's cost model, in ns (2 loaded cores): a numpy round's calls, a compared token, and a
# token of one level of `_doubling_lengths` (its sort)
_ROUND_COST = 20_000
_TOKEN_COST = 20
_SORT_COST = 15


@dataclass(frozen=True)
class DryBreakers:
    """A request's processed breakers as lookups over the vocabulary."""

    is_head: np.ndarray  # [vocab] bool: the token starts some breaker
    is_single: np.ndarray  # [vocab] bool: the token is a breaker by itself (never penalized)
    tails: dict[int, list[np.ndarray]]  # head -> its non-empty tails, longest first

    @classmethod
    def build(cls, sequences: list[list[int]], vocab_size: int) -> DryBreakers:
        is_head = np.zeros(vocab_size, dtype=bool)
        is_single = np.zeros(vocab_size, dtype=bool)
        tails: dict[int, list[np.ndarray]] = {}
        for head, *tail in sequences:
            if 0 <= head < vocab_size:
                is_head[head] = True
                if tail:
                    tails.setdefault(head, []).append(np.array(tail, dtype=np.int64))
                else:
                    is_single[head] = True
        for found in tails.values():
            found.sort(key=len, reverse=True)
        return cls(is_head, is_single, tails)


def apply_dry(logits: torch.Tensor, state: SamplingState, batch: SamplingBatch) -> None:
    """Penalize, in place, the tokens that would extend a repeat of each flagged row's history
    (the module's steps 1-4). One Python pass per flagged row; one scatter for all."""
    rows = batch.rows(state.uses["dry"])
    if not len(rows):
        return
    hit_rows, hit_ids, hit_penalties = [], [], []
    for row in rows:
        seq = state.seq(batch.slots[row])
        breakers = _breakers(state, seq)
        history = history_tail(seq.prompt_token_ids,
                               batch.output_before(int(row), seq.output_token_ids),
                               seq.params.dry_penalty_last_n)
        ids, penalties = dry_penalties(history, breakers, seq.params.dry_multiplier,
                                       seq.params.dry_base, seq.params.dry_allowed_length)
        hit_rows.append(np.full(len(ids), row, dtype=np.int64))
        hit_ids.append(ids)
        hit_penalties.append(penalties)
    device = logits.device
    index_rows = torch.from_numpy(np.concatenate(hit_rows)).to(device)
    index_ids = torch.from_numpy(np.concatenate(hit_ids)).to(device)
    # logit + (-penalty) is logit - penalty exactly (each token once a row: no sums)
    logits.index_put_((index_rows, index_ids),
                      torch.from_numpy(-np.concatenate(hit_penalties)).to(device),
                      accumulate=True)


def dry_penalties(history: np.ndarray, breakers: DryBreakers, multiplier: float, base: float,
                  allowed_length: int) -> tuple[np.ndarray, np.ndarray]:
    """The tokens DRY penalizes after `history` (int64 [n], already cut to the window) and
    their penalties: (ids int64 [k], penalties float32 [k])."""
    empty = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32))
    n = len(history)
    if n <= allowed_length:
        return empty
    limit = repeat_limit(history, breakers)
    if limit < allowed_length:
        return empty
    max_exponent = _max_exponent(base)
    cap = limit  # lengths past `cap` change no penalty
    if max_exponent > 0:
        cap = min(cap, allowed_length + max_exponent)
    elif np.float32(base) == 1.0:
        cap = min(cap, allowed_length)
    lengths = repeat_lengths(history, cap)  # [n - 1]
    ends = np.flatnonzero(lengths >= allowed_length)
    if not len(ends):
        return empty
    # 3) the longest repeat each next token would extend
    tokens, lens = history[ends + 1], lengths[ends]
    order = np.lexsort((-lens, tokens))
    tokens, lens = tokens[order], lens[order]
    first = np.ones(len(tokens), dtype=bool)
    first[1:] = tokens[1:] != tokens[:-1]
    tokens, lens = tokens[first], lens[first]
    keep = ~breakers.is_single[tokens]
    tokens, lens = tokens[keep], lens[keep]
    # 4) multiplier * base^exponent: C's pow in float64 (math.pow), one per distinct exponent
    exponents = lens - allowed_length
    if max_exponent > 0:
        exponents = np.minimum(exponents, max_exponent)
    mult, base64 = float(np.float32(multiplier)), float(np.float32(base))
    distinct, at = np.unique(exponents, return_inverse=True)
    table = np.array([mult * math.pow(base64, int(e)) for e in distinct], dtype=np.float64)
    return tokens, table[at].astype(np.float32)


def repeat_limit(history: np.ndarray, breakers: DryBreakers) -> int:
    """Step 1: the number of tokens after the latest complete breaker (head and, of its tails,
    the longest that follows it in the history); len(history) without one."""
    n = len(history)
    for start in np.flatnonzero(breakers.is_head[history])[::-1]:
        head = int(history[start])
        after = n - 1 - int(start)  # tokens after the head
        for tail in breakers.tails.get(head, ()):  # longest first
            if len(tail) <= after and np.array_equal(history[start + 1:start + 1 + len(tail)],
                                                     tail):
                return after - len(tail)
        if breakers.is_single[head]:  # the empty tail: the shortest, it always matches
            return after
    return n


def repeat_lengths(history: np.ndarray, cap: int) -> np.ndarray:
    """Step 2: for each end e in [0, n - 1), min(cap, the longest l such that
    history[e - l + 1 : e + 1] == history[n - l :]), as int64 [n - 1].

    The ends that match the last token extend together, a block of tokens a round, the block
    doubling each round (a gallop: log(cap) rounds); once the rounds would cost more than
    `_doubling_lengths` (many long matches: a short loop, or no clamp), that finishes."""
    n = len(history)
    lengths = np.zeros(max(n - 1, 0), dtype=np.int64)
    if cap <= 0 or n < 2:
        return lengths
    budget = _doubling_cost(n, cap)
    ends = np.flatnonzero(history[:-1] == history[-1])  # the ends matching 1 token
    lengths[ends] = 1
    length, width, spent = 1, 1, n * _TOKEN_COST
    while len(ends) and length < cap:
        block = min(width, cap - length)
        spent += _ROUND_COST + len(ends) * block * _TOKEN_COST
        if spent > budget:  # the rounds stop at twice the doubling's cost at most
            return _doubling_lengths(history, cap)
        offsets = length + np.arange(block)  # [block] tokens back from each end
        at = ends[:, None] - offsets  # [ends, block]; < 0: before the history (no match)
        is_same = (at >= 0) & (history[np.maximum(at, 0)] == history[n - 1 - offsets])
        matched = np.where(is_same.all(axis=1), block, is_same.argmin(axis=1))  # [ends]
        lengths[ends] = length + matched
        ends = ends[matched == block]
        length += block
        width *= 2
    return lengths


def _doubling_cost(n: int, cap: int) -> int:
    """`_doubling_lengths`'s cost in the rounds' units: a sort of n a level, log2(cap) levels."""
    return (min(cap, n).bit_length() + 1) * (_SORT_COST * n + _ROUND_COST)


def _doubling_lengths(history: np.ndarray, cap: int) -> np.ndarray:
    """`repeat_lengths` by prefix doubling over the reversed history, exact (no hashing):
    level j ranks each rev[i : i + 2^j] (equal ranks: equal tokens, the end padded), then each
    start i takes the Z value min(cap, common prefix of rev and rev[i:]) bit by bit, highest
    first. O(n log cap) in numpy: ~0.4 ms at 4,096 tokens and cap 160, ~0.7 ms uncapped."""
    n = len(history)
    rev = history[::-1]
    rank = _dense_ranks(rev)
    ranks, width = [rank], 1
    while 2 * width <= min(cap, n):
        second = np.zeros(n, dtype=np.int64)  # the rank of the second half, 0: past the end
        second[:n - width] = rank[width:] + 1
        rank = _dense_ranks(rank * (n + 1) + second)
        ranks.append(rank)
        width *= 2
    starts = np.arange(1, n)
    z = np.zeros(n - 1, dtype=np.int64)
    for rank in reversed(ranks):  # width: 2^level
        at = starts + z
        is_same = (at + width <= n) & (rank[np.minimum(at, n - 1)] == rank[z])
        z += width * is_same
        width //= 2
    return np.minimum(z[::-1], cap)


def _dense_ranks(keys: np.ndarray) -> np.ndarray:
    """Each key's index among the distinct keys, int64 [n]: np.unique's inverse, at a fifth of
    its cost (numpy's stable argsort, ~30 us at 4,096 keys; np.unique's default sort ~200 us)."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    is_new = np.empty(len(keys), dtype=np.int64)
    is_new[0] = 0
    is_new[1:] = ordered[1:] != ordered[:-1]
    ranks = np.empty(len(keys), dtype=np.int64)
    ranks[order] = np.cumsum(is_new)
    return ranks


def _reverse_z(tokens: list[int]) -> np.ndarray:
    """The uncapped lengths of `repeat_lengths`, by the Z algorithm over the reversed tokens
    (z[k]: the common prefix of reversed and reversed[k:], the repeat ending at n - 1 - k)."""
    n = len(tokens)
    rev = tokens[::-1]
    z = [0] * n
    left = right = 0  # the Z box [left, right): rev[left:right] == rev[:right - left]
    for k in range(1, n):
        length = min(right - k, z[k - left]) if k < right else 0
        while k + length < n and rev[length] == rev[k + length]:
            length += 1
        z[k] = length
        if k + length > right:
            left, right = k, k + length
    return np.array(z[1:][::-1], dtype=np.int64)


def _max_exponent(base: float) -> int:
    """llama.cpp's clamp on the exponent, in its float32 arithmetic; 0: no clamp."""
    base32 = np.float32(base)
    if not base32 > np.float32(1.000001):
        return 0
    return int(FLOAT_MAX_LOG / np.float32(math.log(float(base32))))


# -- each slot's breakers, built once per request --------------------------------------------
_CACHE: weakref.WeakKeyDictionary[SamplingState, dict[int, tuple[SequenceData, DryBreakers]]] \
    = weakref.WeakKeyDictionary()


def _breakers(state: SamplingState, seq: SequenceData) -> DryBreakers:
    """The sequence's `DryBreakers`, built on its first step in the slot (the sequence object
    is the key: a new request, or a preempted one readmitted, is a new object)."""
    slots = _CACHE.setdefault(state, {})
    cached = slots.get(seq.slot)
    if cached is None or cached[0] is not seq:
        cached = (seq, DryBreakers.build(seq.params.dry_breaker_token_ids, state.vocab_size))
        slots[seq.slot] = cached
    return cached[1]

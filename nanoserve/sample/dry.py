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

Step 2 extends all the matching positions together with numpy, one token a round, and only up
to the length past which the penalty no longer grows (allowed_length + the clamp); where long
matches make the rounds cost more than the Z algorithm would (`_ROUND_COST`, `_Z_COST`), the
Z algorithm in Python finishes the row in O(n). Per row at a 4,096-token history (2 loaded
Zen 3 cores): ~0.35 ms for text with the default breakers (0.15 ms of it turning the history
into numpy), ~1.2 ms for one 40-token line repeated without a breaker (the rounds stop at the
clamp), ~4 ms where the Z algorithm takes over (that loop with base 1.0000005: no clamp).
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
# Step 2's cost model, in array elements: a numpy round costs its calls (~5 us, as ~1,500
# elements) plus its positions; the Z algorithm ~0.4 us a token in Python (~128 elements)
_ROUND_COST = 1500
_Z_COST = 128


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
    history[e - l + 1 : e + 1] == history[n - l :]), as int64 [n - 1]."""
    n = len(history)
    lengths = np.zeros(n - 1, dtype=np.int64)
    ends = np.arange(n - 1)
    length = spent = 0
    while len(ends) and length < cap:
        spent += _ROUND_COST + len(ends)
        if spent > _Z_COST * n:  # long repeats: the O(n) Z algorithm is cheaper from here
            return np.minimum(_reverse_z(history.tolist()), cap)
        # positions still matching extend by one token if the one before them matches too
        ends = ends[ends >= length]
        ends = ends[history[ends - length] == history[n - 1 - length]]
        length += 1
        lengths[ends] = length
    return lengths


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

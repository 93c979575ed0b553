"""The model-free proposers against brute-force references, incrementally and rebuilt."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

from nanoserve.sample.sequence import SequenceData
from nanoserve.sampling_params import SamplingParams
from nanoserve.spec.ngram import NgramIndex, NgramProposer
from nanoserve.spec.suffix import SuffixIndex, SuffixProposer


def ngram_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n-gram ending the sequence, its latest earlier occurrence, what followed."""
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):  # latest first, ending before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def suffix_reference(tokens: list[int], k: int, depth: int = 24, factor: float = 1.0,
                     min_prob: float = 0.1) -> list[int]:
    """Every earlier position whose preceding tokens match the suffix longest (at least the
    last two), then the most frequent continuation while its share's product holds."""
    end = len(tokens)

    def match_length(position: int) -> int:
        length = 0
        while (length < depth and position - length - 1 >= 0
               and tokens[position - length - 1] == tokens[end - length - 1]):
            length += 1
        return length

    lengths = {p: match_length(p) for p in range(2, end)}
    best = max([n for n in lengths.values() if n >= 2], default=0)
    matches = [p for p, n in lengths.items() if n == best and best >= 2]
    draft: list[int] = []
    score = 1.0
    while matches and len(draft) < min(k, int(factor * best)):
        counts = Counter(tokens[p] for p in matches if p < end)
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        score *= count / len(matches)
        if score < min_prob:
            break
        draft.append(token)
        matches = [p + 1 for p in matches if p < end and tokens[p] == token]
    return draft


def random_tokens(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def test_ngram_index_equals_the_brute_force_lookup_as_tokens_arrive() -> None:
    rng = random.Random(0)
    for trial in range(30):
        tokens = random_tokens(rng, 60, vocab=3 + trial % 5)
        index = NgramIndex(2, 4)
        for i, token in enumerate(tokens):
            index.extend([token])
            assert index.propose(5) == ngram_reference(tokens[:i + 1], 5, 2, 4), (trial, i)


def test_suffix_index_equals_the_brute_force_match() -> None:
    rng = random.Random(1)
    for trial in range(30):
        tokens = random_tokens(rng, 50, vocab=2 + trial % 4)  # < MAX_CANDIDATES occurrences
        index = SuffixIndex()
        for i, token in enumerate(tokens):
            index.extend([token])
            got = index.propose(6, max_depth=24, max_spec_factor=1.0, min_token_prob=0.1)
            assert got == suffix_reference(tokens[:i + 1], 6), (trial, i)


def sequence(slot: int, prompt: list[int], output: list[int]) -> SequenceData:
    return SequenceData(slot, SamplingParams(), prompt, output, 0)


def test_proposers_follow_a_slot_incrementally_and_restart_for_a_new_request() -> None:
    rng = random.Random(2)
    prompt = random_tokens(rng, 40, vocab=6)
    for proposer in (NgramProposer(3, 5), SuffixProposer()):
        output: list[int] = []
        seq = sequence(0, prompt, output)
        for token in random_tokens(rng, 30, vocab=6):
            output.append(token)  # the engine appends committed tokens in place
            fresh = type(proposer)().propose(sequence(0, prompt, list(output)), 4)
            assert list(proposer.propose(seq, 4)) == list(fresh)
        other = [prompt[5]]  # a new request in the same slot: its own list, its own history
        got = proposer.propose(sequence(0, prompt[:10], other), 4)
        assert list(got) == list(type(proposer)().propose(sequence(0, prompt[:10], other), 4))


def test_a_copied_passage_gets_full_drafts() -> None:
    rng = random.Random(3)
    passage = random_tokens(rng, 80, vocab=500)
    prompt = [*passage, 999, 998]  # "now repeat it:"
    output = passage[:10]  # the copy has begun
    for proposer in (NgramProposer(3, 5), SuffixProposer()):
        assert list(proposer.propose(sequence(1, prompt, output), 4)) == passage[10:14]
    assert NgramProposer().propose(sequence(2, random_tokens(rng, 50, 10**6), []), 4) == []


def test_past_outputs_draft_for_the_same_tenant_only_and_are_off_by_default() -> None:
    """suffix_decoding_max_cached_requests: a finished output is matched by the next requests
    of its tenant (the digest of an API key), never by another tenant's, and not at all when 0."""
    rng = random.Random(4)
    answer = random_tokens(rng, 60, vocab=500)
    question = [700, 701, 702]
    on = SuffixProposer(suffix_decoding_max_cached_requests=4)
    off = SuffixProposer()
    for proposer in (on, off):
        proposer.request_finished(dataclasses.replace(
            sequence(0, question, list(answer)), tenant="alice"))
    # the same question again: the answer has begun, and its prompt holds none of it
    again = answer[:6]
    assert list(on.propose(dataclasses.replace(sequence(1, question, again),
                                               tenant="alice"), 4)) == answer[6:10]
    assert list(on.propose(dataclasses.replace(sequence(2, question, list(again)),
                                               tenant="bob"), 4)) == []
    assert list(off.propose(dataclasses.replace(sequence(3, question, list(again)),
                                                tenant="alice"), 4)) == []
    # the oldest outputs go once more than max_cached_requests have finished
    for _ in range(6):
        on.request_finished(dataclasses.replace(
            sequence(0, question, random_tokens(rng, 30, vocab=500)), tenant="alice"))
    assert list(on.propose(dataclasses.replace(sequence(4, question, list(again)),
                                               tenant="alice"), 4)) == []

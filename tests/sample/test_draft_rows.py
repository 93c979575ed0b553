"""Every stage of the pipeline at draft rows: row j of a request's window must be drawn exactly
as a one-token decode after its drafts `d[:j]` were committed.

The check needs no model: random logits for each row, random parameters mixing every stage
that reads a sequence's history (penalties, bad words across the drafts, min_tokens, the
thinking budget, a custom processor that supports speculation) with the ones that do not
(allowed ids, logit bias, temperature, truncation, logprobs). The windowed sampler sees all the
windows in one batch; the reference is a second sampler holding, in its own slot, each
(request, j) as a plain sequence whose output already ends with `d[:j]`. Token ids and
logprobs must agree on every row, on the C++ path and the PyTorch one; afterwards the windowed
sampler must hold counts of the committed tokens only (the next plain step agrees too).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from sampler_harness import EOS, make_seq

from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sample.no_repeat_ngram import NoRepeatNGram
from nanoserve.sample.sampler import Sampler
from nanoserve.sample.sequence import SequenceData
from nanoserve.sampling_params import SamplingParams

VOCAB = 64
REASONING = ReasoningTokens(start=60, end=61)
NUM_REQUESTS = 48
K = 4


def random_params(rng: random.Random, index: int) -> SamplingParams:
    """A mix of stages; every request uses at least one that reads its history."""
    kinds = rng.sample(["penalties", "bad_words", "min_tokens", "thinking", "no_repeat"],
                       rng.randint(1, 3))
    greedy = index % 3 == 0
    params = SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.7, 1.0, 1.3]),
        top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 8]), min_p=rng.choice([0.0, 0.05]),
        seed=1000 + index, max_tokens=100,
        logprobs=rng.choice([None, 2]), logprobs_mode=rng.choice(["raw", "processed"]),
        logit_bias={5: 3.0, 6: -2.0} if index % 4 == 1 else None,
        allowed_token_ids=[*range(40), 60, 61] if index % 5 == 2 else None)
    if "penalties" in kinds:
        params = dataclasses.replace(params, repetition_penalty=rng.choice([1.0, 1.4]),
                                     frequency_penalty=rng.choice([0.0, 0.8]),
                                     presence_penalty=0.6)
    if "min_tokens" in kinds:  # the boundary inside the window: output 6 + 0..4
        params = dataclasses.replace(params, min_tokens=rng.randint(7, 10),
                                     stop_token_ids=[7])
    if "thinking" in kinds:
        params = dataclasses.replace(params, thinking_token_budget=rng.randint(0, 4))
    if "no_repeat" in kinds:
        params = dataclasses.replace(params, extra_args={"no_repeat_ngram_size": 2})
    if "bad_words" in kinds:
        # words whose prefixes the drafts complete
        params.bad_words_token_ids = [[3], [1, 2], [2, 4, 5], [9, 1], [2, 2], [4, 9]]
    return params


def windows(seed: int) -> list[tuple[SequenceData, list[int]]]:
    """Requests (prompt, committed output) and their drafts: small token ids, so the drafts
    repeat the output and each other (penalties, n-grams and bad words all fire)."""
    rng = random.Random(seed)
    found = []
    for i in range(NUM_REQUESTS):
        params = random_params(rng, i)
        prompt = [rng.randint(1, 12) for _ in range(rng.randint(3, 8))]
        if params.thinking_token_budget is not None:
            prompt.append(REASONING.start)  # the template opened the section
        output = [rng.randint(1, 12) for _ in range(6)]
        # drafts from few tokens: they repeat each other (n-grams, bad words across drafts)
        drafts = [rng.choice([1, 2, 2, 4, 5, 9, EOS, 7, REASONING.end])
                  for _ in range(rng.randint(0, K))]
        found.append((make_seq(params, prompt, output), drafts))
    return found


def sampler_for(seqs: list[SequenceData], use_kernels: bool) -> Sampler:
    sampler = Sampler(len(seqs), VOCAB, torch.device("cpu"), (EOS,), REASONING,
                      [NoRepeatNGram], use_kernels=use_kernels)
    for slot, seq in enumerate(seqs):
        sampler.validate(seq.params)
        sampler.add_request(dataclasses.replace(seq, slot=slot))
    return sampler


def logprob_tuple(entry):  # type: ignore[no-untyped-def]
    return None if entry is None else (entry.token_id, entry.logprob, entry.top_ids,
                                       entry.top_logprobs)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_draft_row_is_drawn_as_a_decode_after_its_drafts(use_kernels: bool,
                                                              seed: int) -> None:
    requests = windows(seed)
    windowed = sampler_for([seq for seq, _ in requests], use_kernels)
    # the reference: (request, j) as a plain sequence whose output ends with drafts[:j]
    plain_seqs = [dataclasses.replace(seq, output_token_ids=[*seq.output_token_ids,
                                                             *drafts[:j]])
                  for seq, drafts in requests for j in range(len(drafts) + 1)]
    reference = sampler_for(plain_seqs, use_kernels)

    num_rows = sum(1 + len(drafts) for _, drafts in requests)
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    slots = np.repeat(np.arange(len(requests)), [1 + len(d) for _, d in requests])
    positions = np.concatenate([np.arange(6, 7 + len(d)) for _, d in requests])
    draft_ids = np.concatenate([[*d, -1] for _, d in requests]).astype(np.int64)
    counts = np.array([1 + len(d) for _, d in requests], dtype=np.int64)
    # most rows favour their draft, so windows accept some (where no stage bans it)
    favoured = np.flatnonzero((draft_ids >= 0) & (np.arange(num_rows) % 5 != 0))
    logits[favoured, draft_ids[favoured]] += 8.0
    got = windowed.sample(logits.clone(), windowed.make_batch(slots, positions, draft_ids,
                                                              counts))
    want = reference.sample(logits.clone(), reference.make_batch(np.arange(num_rows)))

    assert got.token_ids == want.token_ids
    assert [logprob_tuple(e) for e in got.logprobs] == [logprob_tuple(e) for e in want.logprobs]
    # accepted: the drafts equal to the draws before the first mismatch
    row = 0
    for (_, drafts), taken in zip(requests, got.num_accepted, strict=True):
        draws = want.token_ids[row : row + len(drafts) + 1]
        matched = 0
        while matched < len(drafts) and draws[matched] == drafts[matched]:
            matched += 1
        assert taken == 1 + matched
        row += len(drafts) + 1
    assert any(n > 1 for n in got.num_accepted), "no window accepted a draft: a weak test"

    # the sampler's state counts only what was committed: one more plain step agrees with a
    # sampler that was handed the committed output from the start
    committed_seqs = []
    row = 0
    for slot, ((seq, drafts), taken) in enumerate(zip(requests, got.num_accepted,
                                                      strict=True)):
        committed = got.token_ids[row : row + taken]
        seq.output_token_ids.extend(committed)  # type: ignore[attr-defined]
        committed_seqs.append(dataclasses.replace(seq, slot=slot))
        row += len(drafts) + 1
    fresh = sampler_for(committed_seqs, use_kernels)
    assert torch.equal(windowed.state.output_counts, fresh.state.output_counts)
    assert [(t.phase, t.count) for t in windowed.state.thinking] == [
        (t.phase, t.count) for t in fresh.state.thinking]
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(99)) * 3
    nxt = windowed.sample(logits.clone(), windowed.make_batch(np.arange(len(requests))))
    ref = fresh.sample(logits.clone(), fresh.make_batch(np.arange(len(requests))))
    assert nxt.token_ids == ref.token_ids


def test_a_processor_without_speculation_support_refuses_drafts() -> None:
    class Plain(NoRepeatNGram):
        supports_speculation = False

    seq = make_seq(SamplingParams(extra_args={"no_repeat_ngram_size": 3}), [1, 2, 3])
    free = make_seq(SamplingParams(), [1, 2, 3])
    sampler = Sampler(2, VOCAB, torch.device("cpu"), (EOS,), None, [Plain])
    sampler.add_request(dataclasses.replace(seq, slot=0))
    sampler.add_request(dataclasses.replace(free, slot=1))
    assert sampler.refuses_drafts(0) and not sampler.refuses_drafts(1)
    supported = Sampler(1, VOCAB, torch.device("cpu"), (EOS,), None, [NoRepeatNGram])
    supported.add_request(seq)
    assert not supported.refuses_drafts(0)

"""The sampler's chi-square test, repeated with speculation on: 3,000 seeded requests whose
first two tokens drawn in verify windows (output positions 1 and 2: the first after the draft
positions begin) follow the model's own distribution, pairs included.

A wrong key at a draft row (the row's index instead of its output position, or noise reused
from the row before) would tie the second token to the first; an acceptance test other than
"equal to the target's draw" would skew it towards the drafts. On a tiny Llama (random
weights, fast) with `allowed_token_ids` keeping eight tokens, the drafts are guesses among
those eight (accepted about as often as the model draws them), k = 3. Expected counts come from
the model's processed logprobs at every context reached; the counts with speculation off
(other seeds) must agree too.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

from nanoserve import LLM
from nanoserve.engine.drafts import load_draft_proposer
from nanoserve.sample.sequence import SequenceData
from nanoserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
NUM_SEEDS = 3000
WAVE = 250
ALLOWED = [264, 282, 309, 314, 327, 347, 355, 378]  # eight ordinary word pieces
PROMPT = [1, 504, 3458, 282, 260, 6051, 314]


class GuessAmongAllowed:
    """Drafts k tokens picked among the request's allowed ids, keyed by (seed, position)."""

    def propose(self, seq: SequenceData, num_tokens: int) -> Sequence[int]:
        rng = random.Random(seq.seed * 7919 + len(seq.output_token_ids))
        allowed = seq.params.allowed_token_ids or ALLOWED
        return [rng.choice(allowed) for _ in range(num_tokens)]


def params(seed: int | None = None, **extra: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 3,
                             "allowed_token_ids": ALLOWED, **extra})


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(str(tiny_model_dir("llama")), max_num_seqs=WAVE, max_num_batched_tokens=4096,
               speculative_max_rows=4096, num_speculative_tokens=3)


def generate(llm: LLM, seeds: range, proposer: Any) -> list[list[int]]:
    """In waves that are admitted at once: no prompt waits, so every request drafts."""
    llm.engine.proposer = load_draft_proposer(proposer)
    found = []
    try:
        for start in range(0, len(seeds), WAVE):
            wave = seeds[start : start + WAVE]
            outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(wave),
                                [params(seed) for seed in wave], use_tqdm=False)
            found += [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.proposer = None
    return found


def next_token_probs(llm: LLM, contexts: list[tuple[int, ...]]) -> dict[tuple[int, ...],
                                                                        np.ndarray]:
    """The model's probabilities over ALLOWED after PROMPT + each context."""
    outs = llm.generate([{"prompt_token_ids": PROMPT + list(c)} for c in contexts],
                        params(0, logprobs=len(ALLOWED), logprobs_mode="processed",
                               max_tokens=1), use_tqdm=False)
    found = {}
    for context, out in zip(contexts, outs, strict=True):
        entry = out.outputs[0].logprobs[0]
        probs = np.array([np.exp(entry[t].logprob) for t in ALLOWED])
        found[context] = probs / probs.sum()
    return found


def test_tokens_drawn_in_verify_windows_follow_the_model(llm: LLM) -> None:
    stats = llm.engine.stats
    drafted_before = stats.spec_decode_num_accepted_tokens
    on = generate(llm, range(NUM_SEEDS), GuessAmongAllowed)
    assert stats.spec_decode_num_accepted_tokens - drafted_before > NUM_SEEDS // 4, \
        "too few drafts were accepted for the test to mean anything"
    off = generate(llm, range(NUM_SEEDS, 2 * NUM_SEEDS), None)
    assert all(len(ids) == 3 for ids in on + off)

    firsts = sorted({(ids[0],) for ids in on})
    p1 = next_token_probs(llm, firsts)
    p2 = next_token_probs(llm, sorted({(ids[0], a) for ids in on for a in ALLOWED}))
    expected = np.zeros((len(ALLOWED), len(ALLOWED)))  # [token 1, token 2]
    for ids in on:
        t0 = ids[0]
        for i, a in enumerate(ALLOWED):
            expected[i] += p1[(t0,)][i] * p2[(t0, a)]
    index = {t: i for i, t in enumerate(ALLOWED)}
    got = np.zeros_like(expected)
    for (t1, t2), count in Counter((ids[1], ids[2]) for ids in on).items():
        got[index[t1], index[t2]] = count

    for observed, wanted in ((got.sum(1), expected.sum(1)), (got.sum(0), expected.sum(0)),
                             (got.ravel(), expected.ravel())):
        _, p_value = chisquare(observed, wanted)
        assert p_value > 0.001, (observed, wanted.round(1))
    off_pairs = np.zeros_like(got)
    for ids in off:
        off_pairs[index[ids[1]], index[ids[2]]] += 1
    _, p_value, _, _ = chi2_contingency(np.stack([got.ravel(), off_pairs.ravel()]))
    assert p_value > 0.001

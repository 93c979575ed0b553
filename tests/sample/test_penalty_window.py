"""The penalties' window (nanoserve/sample/penalty_window.py) against llama.cpp's `penalties`
sampler written the plain way: a count per token of the last `repeat_last_n` tokens of prompt
and output, then its float32 operations on each counted token."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from sampler_harness import admit, batch_of, make_seq

from nanoserve.sample.penalty_window import apply_penalty_window, history_tail
from nanoserve.sampling_params import SamplingParams

VOCAB = 24


def ref_window(row: np.ndarray, history: list[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's llama_sampler_penalties_apply over the ring buffer of the last N tokens."""
    row = row.copy()
    n = p.repeat_last_n
    assert n is not None and n != 0
    window = history if n == -1 else history[-n:]
    rep, freq, pres = (np.float32(v) for v in (p.repetition_penalty, p.frequency_penalty,
                                               p.presence_penalty))
    for token, count in Counter(window).items():
        x = row[token]
        x = x * rep if x <= 0 else x / rep
        row[token] = x - (np.float32(count) * freq + np.float32(1.0) * pres)
    return row


def params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(3))
def test_windows_equal_llama_cpp(seed: int) -> None:
    rng = random.Random(seed)
    seqs, histories, ps = [], [], []
    for _ in range(40):
        p = params(repeat_last_n=rng.choice([-1, 1, 3, 8, 64]),
                   repetition_penalty=rng.choice([1.0, 1.1, 1.7]),
                   frequency_penalty=rng.choice([0.0, 0.3, -0.7]),
                   presence_penalty=rng.choice([0.0, 0.5, 1.9]))
        if not p.has_penalty_window:
            p = params(repeat_last_n=p.repeat_last_n, repetition_penalty=1.3)
        history = [rng.randrange(8) for _ in range(rng.randint(1, 30))]
        split = rng.randint(1, len(history))
        seqs.append(make_seq(p, history[:split], history[split:]))
        histories.append(history)
        ps.append(p)
    sampler = admit(seqs, VOCAB)
    assert sampler.state.uses["penalty_window"].all()
    assert not sampler.state.uses["penalties"].any()  # vLLM's penalties do not run too
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    original = logits.clone()
    apply_penalty_window(logits, sampler.state, batch_of(sampler, seqs))
    want = np.stack([ref_window(row, h, p)
                     for row, h, p in zip(original.numpy(), histories, ps, strict=True)])
    assert np.array_equal(logits.numpy(), want)
    assert (logits != original).any(dim=1).all()
    assert torch.equal(logits[:, 8:], original[:, 8:])  # tokens never seen: untouched


def test_the_window_counts_prompt_and_output() -> None:
    # token 3 is in the prompt only: vLLM's frequency penalty counts the output, llama.cpp's
    # window the whole history (llama-server feeds the prompt to its sampler)
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 1.0
    seqs = [make_seq(params(frequency_penalty=2.0), [3, 3], [4]),
            make_seq(params(frequency_penalty=2.0, repeat_last_n=-1), [3, 3], [4])]
    sampler = admit(seqs, VOCAB)
    out = sampler.sample(logits.clone(), batch_of(sampler, seqs))
    assert out.token_ids == [3, 0]  # greedy rows are penalized too
    logits = torch.zeros(1, VOCAB)
    seq = make_seq(params(frequency_penalty=0.5, repeat_last_n=2), [3, 3, 3], [4])
    sampler = admit([seq], VOCAB)
    apply_penalty_window(logits, sampler.state, batch_of(sampler, [seq]))
    assert logits[0, 3] == -0.5 and logits[0, 4] == -0.5  # one 3 and the 4 in the window
    assert (logits[0] != 0).sum() == 2


def test_repeat_last_n_zero_turns_penalties_off() -> None:
    seq = make_seq(params(frequency_penalty=2.0, repetition_penalty=1.5, repeat_last_n=0),
                   [3], [3])
    sampler = admit([seq], VOCAB)
    assert not sampler.state.uses["penalty_window"][0]
    assert not sampler.state.uses["penalties"][0]


def test_history_tail() -> None:
    prompt, output = [1, 2, 3], [4, 5]
    assert history_tail(prompt, output, -1).tolist() == [1, 2, 3, 4, 5]
    assert history_tail(prompt, output, 9).tolist() == [1, 2, 3, 4, 5]
    assert history_tail(prompt, output, 4).tolist() == [2, 3, 4, 5]
    assert history_tail(prompt, output, 2).tolist() == [4, 5]
    assert history_tail(prompt, output, 1).tolist() == [5]
    assert history_tail(prompt, [], 2).tolist() == [2, 3]
    assert history_tail(prompt, output, 0).tolist() == []

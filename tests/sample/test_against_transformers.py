"""The sampler's stages agree with transformers' own logits processors on the same inputs, and
the draw's frequencies match the truncated distribution (chi-squared)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers.generation.logits_process as hf
from sampler_harness import admit, batch_of, make_seq
from scipy.stats import chisquare

from nanoserve.sample.no_repeat_ngram import NoRepeatNGram
from nanoserve.sample.stages import (
    SamplingBatch,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)
from nanoserve.sample.truncation import min_p_threshold, truncate
from nanoserve.sampling_params import SamplingParams

VOCAB = 500
ROWS = 8


def logits_and_history(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randn(ROWS, VOCAB) * 4, torch.randint(0, VOCAB, (ROWS, 30))


def kept_mask(ids: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(ids.shape[0], VOCAB, dtype=torch.bool)
    return mask.scatter_(1, ids, vals > float("-inf"))


@pytest.mark.parametrize("seed", range(5))
def test_truncation_agrees_with_transformers_warpers(seed: int) -> None:
    logits, _ = logits_and_history(seed)
    for temperature in (0.7, 1.3):
        scaled = logits / temperature
        assert torch.equal(scaled, hf.TemperatureLogitsWarper(temperature)(None, logits))
        for name, k, p, m, warper in [
            ("top_k", 20, 1.0, 0.0, hf.TopKLogitsWarper(20)),
            ("top_p", 0, 0.9, 0.0, hf.TopPLogitsWarper(0.9)),
            ("min_p", 0, 1.0, 0.1, hf.MinPLogitsWarper(0.1)),
        ]:
            ids, vals = truncate(scaled, torch.full((ROWS,), k), torch.full((ROWS,), p),
                                 torch.full((ROWS,), min_p_threshold(m)))
            theirs = warper(None, scaled.clone()) > float("-inf")
            assert torch.equal(kept_mask(ids, vals), theirs), name
        # top-k then top-p on the renormalized survivors, as transformers chains them
        ids, vals = truncate(scaled, torch.full((ROWS,), 50), torch.full((ROWS,), 0.8),
                             torch.full((ROWS,), min_p_threshold(0.0)))
        chained = hf.TopPLogitsWarper(0.8)(None, hf.TopKLogitsWarper(50)(None, scaled.clone()))
        assert torch.equal(kept_mask(ids, vals), chained > float("-inf"))


def _apply(stage, params: list[SamplingParams], history: torch.Tensor,  # type: ignore[no-untyped-def]
           logits: torch.Tensor, prompt_len: int = 10) -> torch.Tensor:
    requests = [make_seq(p, history[r, :prompt_len].tolist(),
                         history[r, prompt_len:].tolist()) for r, p in enumerate(params)]
    sampler = admit(requests, VOCAB)
    out = logits.clone()
    stage(out, sampler.state, batch_of(sampler, requests))
    return out


@pytest.mark.parametrize("penalty", [0.6, 1.4])
def test_repetition_penalty_agrees_with_transformers(penalty: float) -> None:
    logits, history = logits_and_history(1)
    ours = _apply(apply_penalties, [SamplingParams(repetition_penalty=penalty)] * ROWS, history,
                  logits)
    theirs = hf.RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_frequency_and_presence_follow_openai_formula() -> None:
    """transformers has no frequency/presence processors; OpenAI documents the formula:
    logit -= count * frequency_penalty + (count > 0) * presence_penalty, over output tokens."""
    logits, history = logits_and_history(2)
    ours = _apply(apply_penalties, [SamplingParams(frequency_penalty=0.5,
                                                   presence_penalty=-1.0)] * ROWS,
                  history, logits)
    counts = torch.zeros(ROWS, VOCAB).scatter_add_(1, history[:, 10:], torch.ones(ROWS, 20))
    expected = logits - counts * 0.5 - (counts > 0).float() * -1.0
    assert torch.allclose(ours, expected, atol=1e-5)


def test_logit_bias_agrees_with_sequence_bias() -> None:
    logits, history = logits_and_history(3)
    bias = {7: 5.0, 99: -3.5, 400: 100.0}
    ours = _apply(apply_logit_bias, [SamplingParams(logit_bias=bias)] * ROWS, history, logits)
    theirs = hf.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(
        history, logits.clone())
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_min_tokens_agrees_with_min_new_tokens() -> None:
    logits, history = logits_and_history(4)
    params = [SamplingParams(min_tokens=25, max_tokens=40, stop_token_ids=[5, 6])] * ROWS
    ours = _apply(apply_min_tokens, params, history, logits)  # 20 outputs < 25: banned
    theirs = hf.MinNewTokensLengthLogitsProcessor(10, 25, [0, 5, 6])(history, logits.clone())
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_no_repeat_ngram_agrees_with_transformers(size: int) -> None:
    logits, history = logits_and_history(5)
    history = history % 12  # small alphabet: plenty of repeats
    params = SamplingParams(extra_args={"no_repeat_ngram_size": size})
    requests = [make_seq(params, history[r, :10].tolist(), history[r, 10:].tolist())
                for r in range(ROWS)]
    sampler = admit(requests, VOCAB, processors=[NoRepeatNGram])
    ours = logits.clone()
    sampler._apply_processors(ours, batch_of(sampler, requests))
    theirs = hf.NoRepeatNGramLogitsProcessor(size)(history, logits.clone())
    assert torch.equal(ours, theirs)


def test_draw_frequencies_pass_chi_squared_in_a_mixed_batch() -> None:
    """100,000 seeded draws per row (one per output position) from known distributions after
    top-k / top-p / min-p, all rows in one batch: frequencies match (p > 0.001)."""
    torch.manual_seed(0)
    vocab, draws = 12, 100_000
    base = torch.randn(vocab) * 1.5
    params = [SamplingParams(temperature=1.0, top_k=5, seed=11),
              SamplingParams(temperature=0.8, top_p=0.7, seed=12),
              SamplingParams(temperature=1.2, min_p=0.1, seed=13),
              SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02, seed=14),
              SamplingParams(temperature=1.0, seed=15),
              SamplingParams(temperature=0.0)]
    requests = [make_seq(p, [1]) for p in params]
    sampler = admit(requests, vocab)
    slots = np.repeat(np.arange(len(params)), draws)
    positions = torch.arange(draws).repeat(len(params))
    batch = SamplingBatch(slots, torch.from_numpy(slots), positions)
    tokens = np.asarray(sampler.sample(base.repeat(len(slots), 1), batch).token_ids)
    for i, p in enumerate(params):
        got = np.bincount(tokens[slots == i], minlength=vocab)
        if p.is_greedy:
            assert got[int(base.argmax())] == draws
            continue
        scaled = base / p.temperature
        ids, vals = truncate(scaled[None], torch.tensor([p.top_k]), torch.tensor([p.top_p]),
                             torch.tensor([min_p_threshold(p.min_p)]))
        probs = torch.zeros(vocab, dtype=torch.float64).scatter_(
            0, ids[0], vals[0].double().softmax(-1)).numpy()
        support = probs > 0
        assert got[~support].sum() == 0
        expected = probs[support] / probs[support].sum() * draws
        _, p_value = chisquare(got[support], expected)
        assert p_value > 0.001, (p, got, probs * draws)

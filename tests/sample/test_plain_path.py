"""The sampler's plain path: a batch of greedy rows that no stage, logprobs, processor or draft
touches is answered by the argmax alone (sampler.py `_sample_plain`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve.sample.sampler import Sampler
from nanoserve.sample.sequence import SequenceData
from nanoserve.sampling_params import SamplingParams

VOCAB = 64


def tricky_logits() -> torch.Tensor:
    """Tied maxima (the first wins, as torch.argmax), a NaN row (NaN wins, as torch.argmax),
    a row of -inf but one, and a plain random row."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[0, [12, 30, 50]] = 9.0
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    logits[2, 40] = 0.0
    return logits


@pytest.mark.parametrize("use_kernels", [True, False])
def test_plain_rows_take_the_argmax(use_kernels: bool) -> None:
    sampler = Sampler(4, VOCAB, torch.device("cpu"), (0,), use_kernels=use_kernels)
    for slot in range(4):
        sampler.add_request(SequenceData(slot, SamplingParams(temperature=0.0), [1], [], 0))
    assert sampler.state.plain[:4].all()
    logits = tricky_logits()
    out = sampler.sample(logits.clone(), sampler.make_batch(np.arange(4)))
    assert out.token_ids == logits.argmax(dim=-1).tolist() == [12, 7, 40, out.token_ids[3]]
    assert out.logprobs == [None] * 4 and out.num_accepted == [1] * 4


def test_a_slot_that_uses_a_stage_is_not_plain_until_it_is_released() -> None:
    sampler = Sampler(2, VOCAB, torch.device("cpu"), (0,))
    greedy = SamplingParams(temperature=0.0)
    sampler.add_request(SequenceData(0, greedy, [1], [], 0))
    sampler.add_request(SequenceData(1, SamplingParams(temperature=0.0, logprobs=2), [1], [], 0))
    assert sampler.state.plain.tolist() == [True, False]
    out = sampler.sample(tricky_logits()[[0, 3]], sampler.make_batch(np.arange(2)))
    assert out.logprobs[0] is None and out.logprobs[1] is not None  # the full pipeline ran
    sampler.remove_request(1)
    assert sampler.state.plain.tolist() == [True, True]
    for params in (SamplingParams(temperature=0.7, seed=1), SamplingParams(
            temperature=0.0, presence_penalty=0.5), SamplingParams(
            temperature=0.0, logit_bias={3: 1.0})):
        sampler.add_request(SequenceData(1, params, [1], [], 0))
        assert sampler.state.plain.tolist() == [True, False]
        sampler.remove_request(1)

"""Builds samplers and batches without a model, and plain per-row reference implementations.

The references are written the simple way (one row at a time, full sorts, Python sets), so the
batched stages can be checked against them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import torch

from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sample.noise import gumbel_noise, row_keys
from nanoserve.sample.sampler import Sampler
from nanoserve.sample.sequence import SequenceData
from nanoserve.sample.stages import SamplingBatch
from nanoserve.sample.truncation import min_p_threshold
from nanoserve.sampling_params import SamplingParams

EOS = 0


def make_seq(params: SamplingParams, prompt: list[int], output: list[int] = (),
             seed: int = 1234) -> SequenceData:
    """A sequence as the engine hands it to the sampler; `admit` gives it its slot."""
    return SequenceData(0, params, list(prompt), list(output),
                        params.seed if params.seed is not None else seed)


def admit(seqs: list[SequenceData], vocab: int,
          reasoning: ReasoningTokens | None = None, processors: list | None = None) -> Sampler:
    """A sampler with sequence i in slot i."""
    sampler = Sampler(len(seqs), vocab, torch.device("cpu"), (EOS,), reasoning,
                      processors or [])
    for slot, seq in enumerate(seqs):
        sampler.validate(seq.params)
        sampler.add_request(dataclasses.replace(seq, slot=slot))
    return sampler


def batch_of(sampler: Sampler, seqs: list[SequenceData]) -> SamplingBatch:
    """One step over `seqs` as `admit` placed them (row i in slot i)."""
    return sampler.make_batch(np.arange(len(seqs)))


# -- references, one row at a time --------------------------------------------------------------
def ref_allowed(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    if p.allowed_token_ids is None:
        return row
    out = torch.full_like(row, float("-inf"))
    ids = torch.tensor(sorted(set(p.allowed_token_ids)))
    out[ids] = row[ids]
    return out


def ref_bad_words(row: torch.Tensor, p: SamplingParams, output: list[int]) -> torch.Tensor:
    row = row.clone()
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and output[-len(prefix):] == prefix):
            row[word[-1]] = float("-inf")
    return row


def ref_min_tokens(row: torch.Tensor, p: SamplingParams, output: list[int]) -> torch.Tensor:
    row = row.clone()
    if len(output) < p.min_tokens:
        for token in ([] if p.ignore_eos else [EOS]) + p.stop_token_ids:
            row[token] = float("-inf")
    return row


def ref_logit_bias(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    row = row.clone()
    for token, bias in (p.logit_bias or {}).items():
        row[token] += bias
    return row


def ref_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int],
                  output: list[int]) -> torch.Tensor:
    row = row.clone()
    for token in set(prompt) | set(output):
        v = row[token]
        row[token] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for token, count in Counter(output).items():
        row[token] -= p.frequency_penalty * count + p.presence_penalty
    return row


def ref_kept(scaled: torch.Tensor, p: SamplingParams) -> set[int]:
    """truncation.py's documented semantics, one row, the plain way: min-p in log space, top-k
    with ties kept, then top-p keeping each token whose mass strictly above it is below top_p
    (so tied tokens are kept or cut together)."""
    vals, ids = torch.sort(scaled, descending=True)
    keep = [bool(v > float("-inf")) for v in vals]
    if p.min_p > 0:
        threshold = torch.tensor(min_p_threshold(p.min_p), dtype=torch.float32)
        keep = [k and bool(v - vals[0] >= threshold) for k, v in zip(keep, vals, strict=True)]
    if p.top_k > 0:
        kth = vals[min(p.top_k, len(vals)) - 1]
        keep = [k and bool(v >= kth) for k, v in zip(keep, vals, strict=True)]
    if p.top_p < 1.0:
        weights = [math.exp(float(v - vals[0])) if k else 0.0 for k, v in zip(keep, vals,
                                                                              strict=True)]
        cut = p.top_k > 0 or p.min_p > 0
        total = sum(weights) if cut else float((scaled.double() - vals[0]).exp().sum())
        values = vals.tolist()
        keep = [k and sum(w for w, u in zip(weights, values, strict=True) if u > v) / total
                < p.top_p for k, v in zip(keep, values, strict=True)]
    return {int(i) for i, k in zip(ids, keep, strict=True) if k}


def ref_draw(scaled: torch.Tensor, kept: set[int], seed: int, position: int) -> int:
    """Gumbel-max over the kept tokens, noise made for this row alone."""
    key = row_keys(torch.tensor([seed]), torch.tensor([position]))
    noise = gumbel_noise(key, torch.arange(scaled.shape[0]))[0]
    scores = torch.full_like(scaled, float("-inf"))
    ids = torch.tensor(sorted(kept))
    scores[ids] = scaled[ids] + noise[ids]
    return int(scores.argmax())


def signed64(seed: int) -> int:
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def as_numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()

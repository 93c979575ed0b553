"""The C++ draw (nanoserve/sample/fused.py, nanoserve/csrc/sampling.cpp) against the PyTorch
path: the same tokens on many rows of realistic logits for every mix of parameters, seeds and
positions; the same noise for every uniform; the same penalties bit for bit; batch invariance;
and the rows the kernel leaves undecided are decided by PyTorch."""

from __future__ import annotations

import itertools
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from helpers import hf_model

from nanoserve.native import load_kernels, missing_build_tool
from nanoserve.sample.fused import UNDECIDED, draw_rows
from nanoserve.sample.noise import gumbel_from_hashes, row_keys
from nanoserve.sample.sampler import Sampler
from nanoserve.sample.sequence import SequenceData
from nanoserve.sample.stages import SamplingBatch, apply_penalties
from nanoserve.sampling_params import SamplingParams

KERNELS = None if missing_build_tool() else load_kernels("sampling")
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="the C++ sampling kernel is not built")

TEMPERATURES = (0.0, 0.3, 0.7, 1.0, 1.5)
TOP_KS = (0, 1, 5, 50, 2000)
TOP_PS = (1.0, 0.5, 0.9, 0.99)
MIN_PS = (0.0, 0.01, 0.1)
EXTRAS: tuple[dict[str, Any], ...] = (  # stages before the draw, on some rows
    {}, {}, {}, dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.3),
    dict(logit_bias={3: 8.0, 7: -100.0, 11: 2.5}))


def every_mix(seed: int) -> list[SamplingParams]:
    """Every temperature x top-k x top-p x min-p, with penalties or bias on some of them."""
    grid = itertools.product(TEMPERATURES, TOP_KS, TOP_PS, MIN_PS)
    return [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=seed * 1000 + i,
                           **EXTRAS[i % len(EXTRAS)])
            for i, (t, k, p, m) in enumerate(grid)]


def peaked_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Like a model's: a few tokens well ahead of a long random tail."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    logits[:, :40] += torch.linspace(10.0, 0.0, 40)
    return logits[:, torch.randperm(vocab, generator=gen)]


def both_paths(logits: torch.Tensor, params: list[SamplingParams],
               positions: list[int]) -> tuple[list[int], list[int], int]:
    """Tokens from the C++ path and from the PyTorch path for the same rows (row i: params[i],
    logits row i, output position positions[i]), and how many rows the kernel leaves undecided
    (counted on the logits before the stages)."""
    prompt = list(range(20, 60))
    tokens = []
    for use_kernels in (True, False):
        sampler = Sampler(len(params), logits.shape[1], torch.device("cpu"), (0,),
                          use_kernels=use_kernels)
        for slot, (p, position) in enumerate(zip(params, positions, strict=True)):
            output = [(slot * 7 + i) % 97 for i in range(position)]
            sampler.add_request(SequenceData(slot, p, prompt, output, p.seed or 0))
        batch = sampler.make_batch(np.arange(len(params)))
        if use_kernels:
            assert sampler.kernels is not None
            undecided = int((draw_rows(sampler.kernels, logits, batch, sampler.state,
                                       np.arange(len(params))) == UNDECIDED).sum())
        tokens.append(sampler.sample(logits.clone(), batch).token_ids)
    return tokens[0], tokens[1], undecided


@needs_kernels
@pytest.mark.parametrize("source", ["peaked", "flat"])
def test_both_paths_draw_the_same_tokens_for_every_mix(source: str) -> None:
    params = every_mix(seed=1)
    vocab = 4096
    logits = (peaked_logits(len(params), vocab, seed=2) if source == "peaked"
              else torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(3)))
    kernel, pytorch, undecided = both_paths(logits, params, [i % 9 for i in range(len(params))])
    assert kernel == pytorch
    assert undecided <= len(params) // 20  # the kernel decides nearly every row itself


@needs_kernels
@pytest.mark.slow
def test_both_paths_agree_on_the_tiny_model_and_full_vocabularies(
        tiny_model_dir: Any) -> None:
    """The tiny model's logits at 48 positions of a prompt, and peaked random rows, over its
    49,152-token vocabulary; several seeds and output positions."""
    model = hf_model(tiny_model_dir("llama"))
    prompt = torch.randint(100, 20000, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        tiny = model(prompt).logits[0].float()  # [48, 49152]
    mismatches, undecided_rows, rows = 0, 0, 0
    for seed in range(3):
        params = every_mix(seed)
        for logits in (tiny[torch.arange(len(params)) % tiny.shape[0]],
                       peaked_logits(len(params), tiny.shape[1], seed)):
            positions = [(seed * 13 + i) % 17 for i in range(len(params))]
            kernel, pytorch, undecided = both_paths(logits.contiguous(), params, positions)
            mismatches += sum(a != b for a, b in zip(kernel, pytorch, strict=True))
            undecided_rows += undecided
            rows += len(params)
    assert mismatches == 0
    assert undecided_rows <= rows // 50


@needs_kernels
@pytest.mark.parametrize("use_kernels", [True, False])
def test_a_rows_token_does_not_depend_on_its_batch(use_kernels: bool) -> None:
    """Each of 32 rows drawn alone equals the same row drawn in a batch of 32 (a fresh sampler
    for each draw: sampling counts the drawn token into the penalty rows' state)."""
    params = every_mix(seed=5)[::9][:32]
    logits = peaked_logits(32, 4096, seed=6)

    def sampler_for(slots: range) -> Sampler:
        sampler = Sampler(32, 4096, torch.device("cpu"), (0,), use_kernels=use_kernels)
        for slot in slots:
            output = [4 + slot % 3] * slot
            sampler.add_request(SequenceData(slot, params[slot], [1, 2, 3], output,
                                             params[slot].seed or 0))
        return sampler

    batched = sampler_for(range(32))
    together = batched.sample(logits.clone(), batched.make_batch(np.arange(32))).token_ids
    alone = [sampler_for(range(slot, slot + 1)).sample(
        logits[slot:slot + 1].clone(), SamplingBatch(
            np.array([slot]), torch.tensor([slot]), torch.tensor([slot]))).token_ids[0]
        for slot in range(32)]
    assert together == alone


@needs_kernels
def test_noise_equals_pytorchs_within_one_ulp_for_every_uniform() -> None:
    """Every 24-bit uniform: the kernel's Gumbel noise is within 2^-20 of noise.py's, its bound
    is above it, and the top value (u rounds to 1.0 in float32) stays finite."""
    assert KERNELS is not None
    hashes = (torch.arange(1 << 24, dtype=torch.int32) << 8) | 0x5A  # top 24 bits: every value
    ours, bound = KERNELS.gumbel_from_hashes(hashes)
    theirs = gumbel_from_hashes(hashes)
    assert bool(theirs.isfinite().all())
    assert float((ours - theirs).abs().max()) <= 2.0**-20
    assert bool((bound >= theirs).all())
    seeds = torch.randint(-2**63, 2**63 - 1, (10_000,), generator=torch.Generator().manual_seed(7))
    positions = torch.randint(0, 1 << 40, (10_000,), generator=torch.Generator().manual_seed(8))
    assert torch.equal(KERNELS.row_keys(seeds, positions), row_keys(seeds, positions))


@needs_kernels
def test_penalties_equal_pytorchs_bit_for_bit() -> None:
    vocab = 1001  # not a multiple of 8: the scalar tail too
    gen = torch.Generator().manual_seed(9)
    params = [SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in itertools.product((1.0, 0.7, 1.3), (0.0, -1.5, 0.8), (0.0, 1.2, -0.4))]
    sampler = Sampler(len(params), vocab, torch.device("cpu"), (0,))
    for slot, p in enumerate(params):
        prompt = torch.randint(0, vocab, (60,), generator=gen).tolist()
        output = torch.randint(0, vocab, (40,), generator=gen).tolist()
        sampler.add_request(SequenceData(slot, p, prompt, output, 1))
    batch = sampler.make_batch(np.arange(len(params)))
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    logits[:, ::7], logits[:, 1::7] = 0.0, -0.0  # signed zeros stay as PyTorch leaves them
    ours, theirs = logits.clone(), logits.clone()
    apply_penalties(ours, sampler.state, batch, KERNELS)
    apply_penalties(theirs, sampler.state, batch, None)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    assert not torch.equal(ours, logits)


@needs_kernels
def test_undecided_rows_are_drawn_by_pytorch_with_ties_kept() -> None:
    """Four tied best tokens and top_p=0.5: the mass before the third is exactly 0.5, so the
    kernel cannot be sure and leaves the row to PyTorch; the mass strictly above each of the
    four is 0, so all four are kept (a positional cut would keep two). A NaN row and tied
    greedy rows too."""
    vocab, draws = 64, 64
    logits = torch.full((draws + 2, vocab), float("-inf"))
    logits[:draws, [9, 20, 33, 41]] = 3.0
    logits[draws, 5] = float("nan")
    logits[draws + 1, [12, 30]] = 4.0  # greedy: the first of equal maxima, as torch.argmax
    params = [SamplingParams(temperature=1.0, top_p=0.5, seed=11)] * (draws + 1) + [
        SamplingParams(temperature=0.0)]
    sampler = Sampler(len(params), vocab, torch.device("cpu"), (0,))
    for slot, p in enumerate(params):
        sampler.add_request(SequenceData(slot, p, [1], [], 11))
    slots = np.arange(len(params))
    positions = torch.tensor([*range(draws), 0, 0])  # each tied row at its own position
    batch = SamplingBatch(slots, torch.from_numpy(slots), positions)
    assert sampler.kernels is not None
    raw = draw_rows(sampler.kernels, logits, batch, sampler.state, slots)
    assert (raw[:draws + 1] == UNDECIDED).all() and raw[-1] == 12
    tokens = sampler.sample(logits.clone(), batch).token_ids
    assert set(tokens[:draws]) == {9, 20, 33, 41}
    assert tokens[-1] == 12
    reference = Sampler(len(params), vocab, torch.device("cpu"), (0,), use_kernels=False)
    for slot, p in enumerate(params):
        reference.add_request(SequenceData(slot, p, [1], [], 11))
    assert reference.sample(logits.clone(), batch).token_ids == tokens


def test_without_a_compiler_the_pytorch_path_samples() -> None:
    """A fresh interpreter with no compiler: one warning, no kernel, tokens all the same."""
    script = (
        "import warnings, numpy as np, torch\n"
        "from nanoserve.sample.sampler import Sampler\n"
        "from nanoserve.sample.sequence import SequenceData\n"
        "from nanoserve.sampling_params import SamplingParams\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    sampler = Sampler(2, 50, torch.device('cpu'))\n"
        "assert sampler.kernels is None\n"
        "print(caught[0].message)\n"
        "for slot, p in enumerate([SamplingParams(temperature=0.0),\n"
        "                          SamplingParams(temperature=0.8, top_p=0.9, seed=3)]):\n"
        "    sampler.add_request(SequenceData(slot, p, [1], [], 3))\n"
        "print(sampler.sample(torch.randn(2, 50), sampler.make_batch(np.arange(2))).token_ids)\n"
    )
    env = {"CXX": "no-such-compiler-g++", "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "C++ kernels unavailable (no C++ compiler" in out.stdout

"""`nanoserve bench sampler --mix llama`: what llama.cpp's samplers cost in the batched sampler.

The same real logits as the main sampler bench (the default model's at each position of a
text), each batch sampled with the vLLM mix of that bench and then with every row using one of
llama.cpp's samplers (DRY, the penalties' window, typical-p, top-n-sigma, XTC, Mirostat 2),
the samplers timed in turn (A B C ... A B C ...). Every row's history is `history` tokens of
real text (its prompt, a paragraph repeated: the loops DRY is for) plus 30 outputs, since DRY
and the window read it each step. The llama.cpp draw samplers take the PyTorch draw
(llama_draw.py), DRY and the window per-row numpy; the ratios are what a batch of such
requests pays over the common mix, whose rows the C++ path draws.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from functools import partial

import numpy as np
import torch

from nanoserve.bench import LLMFactory
from nanoserve.bench.sampler import (
    interleaved_medians_ms,
    mixed_params,
    real_logits,
    text_ids,
    time_sample,
)
from nanoserve.engine_args import EngineArgs
from nanoserve.sample.sampler import Sampler
from nanoserve.sample.sequence import SequenceData
from nanoserve.sampling_params import SamplingParams

LLAMA_SAMPLERS = [  # (column, params): each llama.cpp sampler beside vLLM's usual ones
    ("DRY", dict(temperature=0.8, top_p=0.95, dry_multiplier=0.8)),
    ("window", dict(temperature=0.7, repetition_penalty=1.1, repeat_last_n=64)),
    ("typical", dict(temperature=0.8, typical_p=0.9)),
    ("top-n-sigma", dict(temperature=1.0, top_n_sigma=1.0)),
    ("XTC", dict(temperature=1.0, min_p=0.02, xtc_probability=0.5, xtc_threshold=0.1)),
    ("mirostat 2", dict(temperature=0.8, mirostat=2)),
]


def llama_params(batch: int, kwargs: Mapping[str, object], tokenizer: object
                 ) -> list[SamplingParams]:
    """`batch` rows of one sampler's settings, seeds 0..batch-1."""
    out = []
    for i in range(batch):
        params = SamplingParams(max_tokens=64, seed=i, **kwargs)  # type: ignore[arg-type]
        params.update_from_tokenizer(tokenizer)  # DRY's breakers as token ids
        out.append(params)
    return out


def sampler_with_history(params: list[SamplingParams], vocab: int, history: list[int]
                         ) -> Sampler:
    sampler = Sampler(len(params), vocab, torch.device("cpu"), eos_token_ids=(2,))
    for slot, p in enumerate(params):
        sampler.add_request(SequenceData(slot, p, history, history[-30:], p.seed or 0))
    return sampler


def run_llama_mix_bench(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    """Print, per batch size, the median ms of one `sample` call with each mix."""
    llm = build_llm(EngineArgs.from_cli_args(args))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    repeats, history_len = args.repeats, args.history
    vocab = llm.engine.model_info.arch.vocab_size
    history = text_ids(llm, history_len)
    print(f"logits [B, {vocab}] from {llm.engine.model_info.name}; each row's history "
          f"{history_len} + 30 tokens; threads={torch.get_num_threads()}; medians of "
          f"{repeats}, interleaved\n")
    names = ["vLLM mix", *(name for name, _ in LLAMA_SAMPLERS)]
    print("ms per sample() call: " + " ".join(f"{n:>12}" for n in ["B", *names]))
    for batch in sizes:
        logits = real_logits(llm, batch)
        timers = []
        for params in [mixed_params(batch), *(llama_params(batch, kwargs, llm.tokenizer)
                                              for _, kwargs in LLAMA_SAMPLERS)]:
            sampler = sampler_with_history(params, vocab, history)
            rows = sampler.make_batch(np.arange(batch))
            timers.append(partial(time_sample, sampler, logits, torch.empty_like(logits),
                                  rows))
        ms = interleaved_medians_ms(timers, [repeats] * len(timers))
        print(" " * 22 + f"{batch:>12} " + " ".join(f"{m:12.2f}" for m in ms))
        print(" " * 22 + f"{'vs vLLM mix':>12} " + " ".join(f"{m / ms[0]:11.1f}x" for m in ms))
    return 0

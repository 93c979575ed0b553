"""`nanoserve bench sampler --mix llama`: what llama.cpp's samplers cost in the batched sampler.

The same real logits as the main sampler bench (the default model's at each position of a
text), each batch sampled twice in turn (A B A B ...): once with the vLLM mix of that bench and
once with a mix where every row uses one of llama.cpp's samplers (DRY, the penalties' window,
typical-p, top-n-sigma, XTC, Mirostat 2). Every row's history is `history` tokens of real text
(its prompt) plus 30 outputs, since DRY and the window read it each step. The llama.cpp rows
take the PyTorch draw (llama_draw.py) and per-row Python for DRY and the window; the ratio is
what a batch of such requests pays over the common mix, whose rows the C++ path draws.
"""

from __future__ import annotations

import argparse
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

LLAMA_MIX = [  # (share of rows, params): each row one of llama.cpp's samplers
    (0.20, dict(temperature=0.8, top_p=0.95, dry_multiplier=0.8)),
    (0.20, dict(temperature=0.7, repetition_penalty=1.1, repeat_last_n=64)),
    (0.15, dict(temperature=0.8, typical_p=0.9)),
    (0.15, dict(temperature=1.0, top_n_sigma=1.0)),
    (0.15, dict(temperature=1.0, min_p=0.02, xtc_probability=0.5, xtc_threshold=0.1)),
    (0.15, dict(temperature=0.8, mirostat=2)),
]


def llama_params(batch: int, tokenizer: object, seed: int = 0) -> list[SamplingParams]:
    shares = np.cumsum([share for share, _ in LLAMA_MIX])
    out = []
    for i in range(batch):
        kind = int(np.searchsorted(shares, (i + 0.5) / batch))
        params = SamplingParams(max_tokens=64, seed=seed + i, **LLAMA_MIX[kind][1])  # type: ignore[arg-type]
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
    print(f"{'B':>5} {'vLLM mix ms':>12} {'llama.cpp mix ms':>17} {'ratio':>7}")
    for batch in sizes:
        logits = real_logits(llm, batch)
        timers = []
        for params in (mixed_params(batch), llama_params(batch, llm.tokenizer)):
            sampler = sampler_with_history(params, vocab, history)
            rows = sampler.make_batch(np.arange(batch))
            timers.append(partial(time_sample, sampler, logits, torch.empty_like(logits),
                                  rows))
        common, llama = interleaved_medians_ms(timers, [repeats, repeats])
        print(f"{batch:>5} {common:12.2f} {llama:17.2f} {llama / common:6.1f}x")
    return 0

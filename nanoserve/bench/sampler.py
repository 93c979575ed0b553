"""`nanoserve bench sampler`: the batched sampler beside two textbook samplers, same logits.

Logits are real: the default model's next-token logits at every position of a text, so top-p
and min-p keep as many tokens as they do in practice. Each row gets parameters from a realistic
mix (greedy, nucleus, top-k, min-p, penalties, bias, logprobs). The timed call is
`Sampler.sample` alone. Peers, timed in turn with it (A B C D A B C D ...) because the machines
it runs on are shared:
  * PyTorch path: the same sampler without its C++ kernels (fused.py), as it runs on a GPU or
    where no compiler is found;
  * per-row loop: each request processed alone, full sort, torch.multinomial with its own
    seeded generator (what a simple server does);
  * multinomial batch: the whole batch at once, one full sort for top-k/top-p, one
    torch.multinomial call (fast, but seeds cannot be per row).
Then the sampler's share of a real decode step at batch 32.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from nanoserve.bench import LLMFactory, OfflineLLM
from nanoserve.engine.step_input import build_step_input
from nanoserve.engine_args import EngineArgs
from nanoserve.sample.sampler import Sampler
from nanoserve.sample.sequence import SequenceData
from nanoserve.sample.stages import SamplingBatch
from nanoserve.sampling_params import SamplingParams

MIX = [  # (share of rows, params)
    (0.25, dict(temperature=0.0)),
    (0.25, dict(temperature=0.7, top_p=0.9)),
    (0.15, dict(temperature=0.8, top_k=50, top_p=0.95)),
    (0.10, dict(temperature=1.0, min_p=0.05)),
    (0.10, dict(temperature=1.0)),
    (0.10, dict(temperature=0.7, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.3)),
    (0.05, dict(temperature=0.9, top_p=0.9, logit_bias={13: 5.0, 30: -100.0}, logprobs=5)),
]


def mixed_params(batch: int, seed: int = 0) -> list[SamplingParams]:
    shares = np.cumsum([share for share, _ in MIX])
    out = []
    for i in range(batch):
        kind = int(np.searchsorted(shares, (i + 0.5) / batch))
        out.append(SamplingParams(max_tokens=64, seed=seed + i, **MIX[kind][1]))  # type: ignore[arg-type]
    return out


TEXT = ("The history of the printing press begins in the fifteenth century, when "
        "Johannes Gutenberg combined movable metal type, oil-based ink and a wooden press. "
        "Within decades, printing spread across Europe, and books became cheaper, more "
        "numerous and more uniform. Scholars could compare identical copies; merchants "
        "printed forms; reformers printed pamphlets. ")


def text_ids(llm: OfflineLLM, num_tokens: int) -> list[int]:
    """The first `num_tokens` token ids of a plain English text (repeated as needed)."""
    ids = llm.tokenizer.encode(TEXT)
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def real_logits(llm: OfflineLLM, rows: int) -> torch.Tensor:
    """The default model's logits at `rows` positions of a text (cycled if needed)."""
    ids = text_ids(llm, 300)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    llm.engine.add_request("bench-logits", ids, params)
    engine = llm.engine
    sched = engine.scheduler.schedule()
    for s in sched.scheduled:
        assert s.request.slot is not None
        engine.block_table.sync(s.request.slot, engine.kv_cache.block_ids(s.request.request_id))
    step = build_step_input(sched.scheduled, engine.block_table, engine.kv_cache.block_size,
                            [], [], (np.zeros(0, dtype=np.int64), np.zeros((0, 0), np.int32)))
    _, prompt_logits = engine.runner.execute(step)
    engine.abort("bench-logits")
    logits = torch.cat(prompt_logits)
    return logits[torch.arange(rows) % logits.shape[0]].contiguous()


def make_sampler(params: list[SamplingParams], vocab: int, use_kernels: bool = True
                 ) -> tuple[Sampler, list[SequenceData]]:
    sampler = Sampler(len(params), vocab, torch.device("cpu"), eos_token_ids=(2,),
                      use_kernels=use_kernels)
    seqs = []
    for slot, p in enumerate(params):
        seq = SequenceData(slot, p, [5, 6, 7, 8, 9] * 20, list(range(10, 40)), p.seed or 0)
        sampler.add_request(seq)
        seqs.append(seq)
    return sampler, seqs


def per_row_loop(logits: torch.Tensor, params: list[SamplingParams],
                 seqs: list[SequenceData]) -> list[int]:
    """The textbook sampler: one row at a time, full sort, per-row seeded multinomial."""
    out = []
    for row, p, seq in zip(logits, params, seqs, strict=True):
        row = row.clone()
        if p.has_penalties:
            seen = torch.tensor(sorted({*seq.prompt_token_ids, *seq.output_token_ids}))
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                    vals * p.repetition_penalty)
            ids, counts = torch.tensor(seq.output_token_ids).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts + p.presence_penalty
        for token, bias in (p.logit_bias or {}).items():
            row[token] += bias
        if p.is_greedy:
            out.append(int(row.argmax()))
            continue
        row = row / p.temperature
        out.append(_textbook_draw(row, p, torch.Generator().manual_seed(p.seed or 0)))
        if p.logprobs:
            row.log_softmax(-1).topk(p.logprobs)
    return out


def _textbook_draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    probs = row.softmax(-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    sorted_probs, order = probs.sort(descending=True)
    if p.top_k > 0:
        sorted_probs[p.top_k:] = 0.0
    if p.top_p < 1.0:
        sorted_probs = sorted_probs / sorted_probs.sum()
        above = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(above >= p.top_p, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return int(order[choice])


def multinomial_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The common batched sampler: full sort for top-k/top-p, one torch.multinomial call."""
    temperature = torch.tensor([p.temperature or 1.0 for p in params])[:, None]
    top_k = torch.tensor([p.top_k or logits.shape[1] for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    sorted_logits, order = (logits / temperature).sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1])[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    above = probs.cumsum(-1) - probs
    probs = probs.masked_fill(above >= top_p[:, None], 0.0)
    choice = torch.multinomial(probs, 1)
    tokens = order.gather(1, choice).squeeze(1)
    greedy = torch.tensor([p.is_greedy for p in params])
    return torch.where(greedy, logits.argmax(-1), tokens)


def time_sample(sampler: Sampler, logits: torch.Tensor, buffer: torch.Tensor,
                 batch: SamplingBatch) -> float:
    """Seconds of one `sample` call on fresh logits (the copy is not timed: the sampler edits
    its logits in place, and the engine hands it a new tensor each step)."""
    buffer.copy_(logits)
    start = time.perf_counter()
    sampler.sample(buffer, batch)
    return time.perf_counter() - start


def _time_call(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_medians_ms(timers: Sequence[Callable[[], float]],
                           repeats: Sequence[int]) -> list[float]:
    """Median ms of each timer (a call returning the seconds it measured), run in turn, A B C A
    B C ..., so a shared machine's load falls on all of them alike; timer i runs repeats[i]
    times (after one warm-up call)."""
    times: list[list[float]] = [[] for _ in timers]
    for timer in timers:
        timer()
    for turn in range(max(repeats)):
        for timer, measured, count in zip(timers, times, repeats, strict=True):
            if turn < count:
                measured.append(timer())
    return [statistics.median(measured) * 1e3 for measured in times]


def run_sampler_bench(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    llm = build_llm(EngineArgs.from_cli_args(args))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    vocab = llm.engine.model_info.arch.vocab_size
    print(f"logits [B, {vocab}] from {llm.engine.model_info.name}, float32, "
          f"threads={torch.get_num_threads()}; medians of {args.repeats}, interleaved\n")
    print(f"{'B':>5} {'nanoserve ms':>13} {'PyTorch path ms':>16} {'per-row loop ms':>16}"
          f" {'multinomial ms':>15} {'vs PyTorch path':>16} {'vs loop':>8}"
          f" {'vs multinomial':>15}")
    for batch in sizes:
        logits = real_logits(llm, batch)
        params = mixed_params(batch)
        timers: list[Callable[[], float]] = []
        repeats: list[int] = []
        for use_kernels in (True, False):  # C++ path (fused.py) where it builds, then PyTorch
            sampler, seqs = make_sampler(params, vocab, use_kernels)
            rows = sampler.make_batch(np.arange(batch))
            timers.append(partial(time_sample, sampler, logits, torch.empty_like(logits), rows))
            repeats.append(args.repeats)
        timers.append(partial(_time_call, partial(per_row_loop, logits, params, seqs)))
        timers.append(partial(_time_call, partial(multinomial_batch, logits, params)))
        repeats += [max(2, args.repeats // (1 + batch // 32)), args.repeats]
        ours, pytorch, loop, multi = interleaved_medians_ms(timers, repeats)
        print(f"{batch:>5} {ours:13.2f} {pytorch:16.2f} {loop:16.2f} {multi:15.2f}"
              f" {pytorch / ours:15.1f}x {loop / ours:7.1f}x {multi / ours:14.1f}x")
    if not args.skip_step_share:
        print()
        for context_len in (64, 128, 256):  # the step grows with the context; sampling does not
            share, step_ms, sample_ms = sampler_share_of_step(llm, 32, context_len)
            print(f"decode step at batch 32 with the mix, {context_len}-token prompts: "
                  f"{step_ms:.1f} ms, of which sampling {sample_ms:.2f} ms = {share:.1%}")
    return 0


def sampler_share_of_step(llm: OfflineLLM, batch: int, context_len: int,
                          steps: int = 10) -> tuple[float, float, float]:
    """Run `batch` requests with the mix through the engine, from `context_len`-token prompts;
    time steps and their sampling."""
    engine = llm.engine
    ids = [f"share{i}" for i in range(batch)]
    prompt = text_ids(llm, context_len)  # real text: the distributions sampling meets in use
    for request_id, p in zip(ids, mixed_params(batch), strict=True):
        p.max_tokens, p.ignore_eos = steps + 8, True
        engine.add_request(request_id, prompt, p)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    step_times, sample_times = [], []
    for _ in itertools.repeat(None, steps):
        before = engine.stats.sample_seconds
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
        sample_times.append(engine.stats.sample_seconds - before)
    for request_id in ids:
        engine.abort(request_id)
    step_ms = statistics.median(step_times) * 1e3
    sample_ms = statistics.median(sample_times) * 1e3
    return sample_ms / step_ms, step_ms, sample_ms

"""`nanoserve bench proposer`: what the draft proposers cost, against a one-stream decode step.

Offline, one request at a time, greedy, natural EOS: each of `bench spec`'s workloads (the
copying ones and open chat) runs once with speculation off and once per method. With
speculation off the figure is the plain batch-1 step (wall time per step); with it on, the
engine's own count of the time spent in `_propose_drafts` (the proposer's index updates and
lookups for every running request, `SchedulerStats.propose_seconds`) per step. The share is
proposer time per step over the plain step: the issue's bound is 2%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from nanoserve.bench import LLMFactory, OfflineLLM
from nanoserve.bench.spec_workloads import COPY_WORKLOADS, workload_prompts
from nanoserve.engine_args import EngineArgs
from nanoserve.sampling_params import SamplingParams


def run_workload(llm: OfflineLLM, workload: str, max_tokens: int
                 ) -> tuple[int, int, float, float]:
    """(output tokens, steps, wall seconds, proposer seconds) of one greedy chat request."""
    stats = llm.engine.stats
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": workload_prompts(workload, 1)[0]}], tokenize=False,
        add_generation_prompt=True)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    steps, proposing = stats.num_steps, stats.propose_seconds
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": list(ids)}],
                       SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    wall = time.perf_counter() - start
    return (len(out[0].outputs[0].token_ids), stats.num_steps - steps, wall,
            stats.propose_seconds - proposing)


def run_proposer_bench(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    workloads = [*COPY_WORKLOADS, "chat"]
    methods = [m for m in args.methods.split(",") if m and m != "off"]
    plain_ms: dict[str, float] = {}
    print(f"one stream, greedy, natural EOS, max_tokens {args.max_tokens}, "
          f"{args.num_speculative_tokens} draft tokens; medians of {args.rounds} rounds")
    print(f"{'workload':<9} {'method':<7} {'tokens':>6} {'steps':>6} {'step ms':>8} "
          f"{'proposer ms/step':>17} {'of a plain step':>16}")
    base = EngineArgs.from_cli_args(args)
    for method in ["off", *methods]:
        config = None if method == "off" else json.dumps(
            {"method": method, "num_speculative_tokens": args.num_speculative_tokens})
        llm = build_llm(dataclasses.replace(base, speculative_config=config))
        run_workload(llm, "chat", 16)  # warm-up: kernels loaded, first allocations made
        for workload in workloads:
            runs = [run_workload(llm, workload, args.max_tokens) for _ in range(args.rounds)]
            tokens, steps = runs[0][0], runs[0][1]
            step_ms = statistics.median(wall / n for _, n, wall, _ in runs) * 1e3
            propose_ms = statistics.median(p / n for _, n, _, p in runs) * 1e3
            if method == "off":
                plain_ms[workload] = step_ms
                share = "-"
            else:
                share = f"{propose_ms / plain_ms[workload]:.2%}"
            print(f"{workload:<9} {method:<7} {tokens:>6} {steps:>6} {step_ms:>8.2f} "
                  f"{propose_ms:>17.3f} {share:>16}")
        del llm
    return 0


def add_proposer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", default="ngram,suffix",
                   help="speculative methods to measure (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--rounds", type=int, default=3)

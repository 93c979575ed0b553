"""`nanoserve bench quality`: what each `--quantization` mode costs in accuracy.

Two figures per mode, both through the real engine (scheduler, chunked prefill, paged KV
cache, sampler), beside the exact float32 mode "none" measured in the same run:

  perplexity  exp of the mean negative log-likelihood of a fixed English text's tokens, each
              given the ones before it (the engine's prompt logprobs, one request);
  agreement   16 short prompts decoded greedily, 32 tokens each, EOS ignored, compared with
              "none": the tokens that match before the first divergence (a mean prefix length
              and its share of the tokens) and the share of positions that match at all.

The text is `tests/data/essay.txt` of a checkout (written for this project, CC0).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nanoserve.bench import LLMFactory
from nanoserve.config import QUANTIZATION_MODES
from nanoserve.engine.core import EngineCore
from nanoserve.engine_args import EngineArgs
from nanoserve.sampling_params import SamplingParams

# Short, varied plain-text prompts (no chat template): continuations, like the text the
# perplexity scores, so both figures look at the same behaviour.
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "To make a simple loaf of bread, you will need",
    "The main causes of the First World War were",
    "Photosynthesis is the process by which plants",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The best advice I ever received was",
    "In economics, inflation refers to",
    "Dear Sir or Madam,\nI am writing to inform you that",
    "The three states of matter are",
    "Water boils at 100 degrees Celsius because",
    "A good night's sleep is important for",
    "The history of the bicycle begins in",
    "Translate into French: 'Good morning, how are you?'\nAnswer:",
    "The largest planet in our solar system is",
    "My favourite thing about autumn is",
)


@dataclass(frozen=True)
class Agreement:
    """Greedy tokens of one engine compared with a reference's, prompt by prompt."""

    mean_prefix_len: float  # tokens equal before the first divergence, mean over prompts
    prefix_share: float  # mean_prefix_len / tokens per prompt
    position_share: float  # share of all positions whose tokens are equal


def text_token_ids(tokenizer: Any, path: Path, num_tokens: int) -> list[int]:
    """The first `num_tokens` token ids of the text at `path`; all of them if it is shorter."""
    return tokenizer.encode(path.read_text(encoding="utf-8"))[:num_tokens]


def prompt_token_ids(tokenizer: Any) -> list[list[int]]:
    """The 16 fixed prompts, tokenized as the text is (with a BOS if the model wants one)."""
    return [tokenizer.encode(p) for p in PROMPTS]


def perplexity(engine: EngineCore, token_ids: list[int]) -> float:
    """exp(mean NLL) of token_ids[1:], each given the tokens before it, in one request.

    The engine returns prompt logprobs with the first sampled token: one `TokenLogprobs` per
    prompt position 1.., whose `logprob` is that prompt token's raw log-probability.
    """
    request_id = "quality-perplexity"
    engine.add_request(request_id, token_ids, SamplingParams(prompt_logprobs=0, max_tokens=1))
    logprobs = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.prompt_logprobs is not None:
                logprobs = out.prompt_logprobs
    if logprobs is None or [lp.token_id for lp in logprobs] != token_ids[1:]:
        raise RuntimeError(f"expected the logprobs of prompt tokens 1..{len(token_ids) - 1}, "
                           f"got {None if logprobs is None else len(logprobs)} entries")
    return math.exp(-sum(lp.logprob for lp in logprobs) / len(logprobs))


def greedy_tokens(engine: EngineCore, prompts: list[list[int]],
                  max_tokens: int) -> list[list[int]]:
    """Exactly `max_tokens` greedy tokens per prompt (EOS ignored), all prompts in one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_ids = [f"quality-greedy-{i}" for i in range(len(prompts))]
    for request_id, ids in zip(request_ids, prompts, strict=True):
        engine.add_request(request_id, ids, params)
    outputs: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[request_id] for request_id in request_ids]


def compare_tokens(tokens: list[list[int]], reference: list[list[int]]) -> Agreement:
    """How far `tokens` follow `reference`: up to the first divergence, and position by
    position (after a divergence the texts differ, so later matches are partly chance)."""
    prefix_lens, num_equal, num_positions = [], 0, 0
    for ours, ref in zip(tokens, reference, strict=True):
        equal = [a == b for a, b in zip(ours, ref, strict=True)]
        prefix_lens.append(equal.index(False) if False in equal else len(equal))
        num_equal += sum(equal)
        num_positions += len(equal)
    return Agreement(sum(prefix_lens) / len(prefix_lens), sum(prefix_lens) / num_positions,
                     num_equal / num_positions)


def greedy_agreement(engine_a: EngineCore, engine_b: EngineCore, prompts: list[list[int]],
                     max_tokens: int) -> Agreement:
    """Greedy decoding of the same prompts in two engines, compared (b is the reference)."""
    return compare_tokens(greedy_tokens(engine_a, prompts, max_tokens),
                          greedy_tokens(engine_b, prompts, max_tokens))


@dataclass(frozen=True)
class ModeResult:
    mode: str
    perplexity: float
    tokens: list[list[int]]
    kv_cache_dtype: str  # what --kv-cache-dtype resolved to for this mode


def measure_mode(build_llm: LLMFactory, engine_args: EngineArgs, mode: str, text: Path,
                 num_tokens: int, max_tokens: int) -> ModeResult:
    """Load the model in `mode`; its perplexity on the text and its greedy tokens."""
    llm = build_llm(replace(engine_args, quantization=mode))
    ids = text_token_ids(llm.tokenizer, text, num_tokens)
    ppl = perplexity(llm.engine, ids)
    tokens = greedy_tokens(llm.engine, prompt_token_ids(llm.tokenizer), max_tokens)
    kv_dtype = str(llm.engine.runner.kv_caches[0][0].dtype).removeprefix("torch.")
    return ModeResult(mode, ppl, tokens, kv_dtype)


def format_table(results: list[ModeResult], max_tokens: int) -> str:
    """The markdown table: each mode's perplexity and greedy agreement against "none"."""
    ref = next(r for r in results if r.mode == "none")
    lines = ["| mode | perplexity | vs none | greedy: mean tokens before divergence "
             f"(of {max_tokens}) | share before divergence | share of equal positions |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        a = compare_tokens(r.tokens, ref.tokens)
        lines.append(f"| {r.mode} | {r.perplexity:.3f} | {r.perplexity / ref.perplexity - 1:+.2%} "
                     f"| {a.mean_prefix_len:.1f} | {a.prefix_share:.1%} "
                     f"| {a.position_share:.1%} |")
    return "\n".join(lines)


def run_quality_bench(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    """Measure every mode in `--modes` ("none" always, first) and print the table."""
    text = Path(args.text)
    if not text.is_file():  # checked before minutes of loading models
        print(f"error: --text {text}: no such file; run from a nanoserve checkout (it holds "
              "tests/data/essay.txt) or give --text PATH to a plain-text file", file=sys.stderr)
        return 2
    modes = ["none", *(m for m in args.modes.split(",") if m and m != "none")]
    unknown = [m for m in modes if m not in QUANTIZATION_MODES]
    if unknown:
        print(f"error: --modes {args.modes}: unknown mode {unknown[0]!r}; choose from "
              f"{', '.join(QUANTIZATION_MODES)}", file=sys.stderr)
        return 2
    engine_args = EngineArgs.from_cli_args(args)
    if args.vs_llama_cpp:
        return _run_vs_llama_cpp(args, build_llm, engine_args, modes, text)
    results = []
    for mode in modes:  # one model loaded at a time; only the tokens are kept
        results.append(measure_mode(build_llm, engine_args, mode, text, args.num_tokens,
                                    args.max_tokens))
        print(f"{mode}: perplexity {results[-1].perplexity:.3f} "
              f"(KV cache {results[-1].kv_cache_dtype})", flush=True)
    print(f"\nperplexity on the first {args.num_tokens} tokens of {text}; greedy agreement with "
          f"none over {len(PROMPTS)} prompts x {args.max_tokens} tokens\n")
    print(format_table(results, args.max_tokens))
    return 0


def _run_vs_llama_cpp(args: argparse.Namespace, build_llm: LLMFactory, engine_args: EngineArgs,
                      modes: list[str], text: Path) -> int:
    """Each mode's perplexity counted as llama.cpp's llama-perplexity counts it, beside the
    tool's own on the same file and text (quality_peer.py)."""
    from nanoserve.bench.quality_peer import run_vs_llama_cpp

    rows = ["| mode | nanoserve | llama-perplexity | difference | tokens scored |",
            "|---|---:|---:|---:|---:|"]
    for mode in modes:
        llm = build_llm(replace(engine_args, quantization=mode))
        rows.append(run_vs_llama_cpp(llm, mode, text, args.ctx_size, args.threads))
        print(rows[-1], flush=True)
        del llm
    print(f"\nperplexity of {text} in chunks of {args.ctx_size} tokens, each chunk's second "
          "half scored (llama-perplexity's count)\n")
    print("\n".join(rows))
    return 0

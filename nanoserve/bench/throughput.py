"""`nanoserve bench throughput`: offline generation speed beside transformers `generate`.

The same random-token prompts go through nanoserve's engine (continuous batching) and through
transformers (one static batch), greedy, EOS ignored, in one run; transformers in float32,
nanoserve with the weights its --quantization gives (a GGUF file's own blocks by default).
Two scenarios: all prompts at once, and a single prompt. Each is timed `--repeats` times,
the two engines taking turns, on fresh prompts each round (so no prefix cache helps); the best
round of each side makes the ratio: on a shared machine a neighbour's load only ever slows a
round, and taking turns gives both sides the same chances. Then a decode step at the chosen
batch is timed beside the same step's matmuls alone (see roofline.py), the floor this
machine sets for the model.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from nanoserve.bench import LLMFactory, OfflineLLM
from nanoserve.bench.roofline import measure_decode_step, measure_matmuls
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine_args import EngineArgs
from nanoserve.sampling_params import SamplingParams


@dataclass
class Result:
    name: str
    num_prompts: int
    seconds: float
    num_output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds


def random_prompts(tokenizer: Any, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Random ordinary (non-special) token ids, the same for both engines."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(count)]


def time_nanoserve(llm: OfflineLLM, prompts: list[list[int]], output_len: int) -> Result:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return Result("nanoserve", len(prompts), seconds,
                  sum(len(o.outputs[0].token_ids) for o in outs))


def load_transformers(model_path: Path) -> Any:
    """The same weights in transformers, float32: the reference for benchmarks and tests."""
    import transformers

    if model_path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path),
                                                                  dtype=torch.float32)
    return model.eval()


def timed_load_transformers(model_path: Path) -> Any:
    """`load_transformers`, saying how long it took."""
    start = time.perf_counter()
    model = load_transformers(model_path)
    print(f"transformers loaded the same weights in {time.perf_counter() - start:.1f} s")
    return model


@torch.inference_mode()
def time_transformers(model: Any, prompts: list[list[int]], output_len: int) -> Result:
    """One static batch (prompts are all the same length, so no padding)."""
    def run(ids: torch.Tensor, n: int) -> Any:
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)

    run(torch.tensor([prompts[0][:8]]), 2)  # warm-up
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    out = run(ids, output_len)
    seconds = time.perf_counter() - start
    return Result("transformers", len(prompts), seconds,
                  (out.shape[1] - ids.shape[1]) * ids.shape[0])


def run_throughput_bench(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    # all prompts at once means that many running together
    engine_args = replace(engine_args,
                          max_num_seqs=max(engine_args.max_num_seqs, args.num_prompts))
    start = time.perf_counter()
    llm = build_llm(engine_args)
    print(f"nanoserve loaded {llm.engine.model_info.name} in {time.perf_counter() - start:.1f} s "
          f"({llm.engine.config.model.torch_device}, threads={torch.get_num_threads()})")
    reference = None if args.skip_transformers else timed_load_transformers(
        llm.engine.model_info.path)
    sizes = [args.num_prompts] + ([] if args.skip_single or args.num_prompts == 1 else [1])
    best: dict[tuple[str, int], Result] = {}  # (engine, sequences) -> its fastest round
    for size in sizes:
        for round_ in range(args.repeats):
            # fresh prompts per round and scenario: no prefix-cache hit from an earlier one
            prompts = random_prompts(llm.tokenizer, size, args.input_len,
                                     seed=1000 * size + round_)
            rounds = [time_nanoserve(llm, prompts, args.output_len)]
            if reference is not None:
                rounds.append(time_transformers(reference, prompts, args.output_len))
            print(f"  {size} sequence{'s' if size > 1 else ''}, round {round_ + 1}: " + ", ".join(
                f"{r.name} {r.tokens_per_s:.1f} tok/s" for r in rounds), flush=True)
            for r in rounds:
                kept = best.get((r.name, size))
                if kept is None or r.tokens_per_s > kept.tokens_per_s:
                    best[r.name, size] = r
    del reference
    ours = [best["nanoserve", size] for size in sizes]
    theirs = [best["transformers", size] for size in sizes if ("transformers", size) in best]

    print(f"\n{args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} "
          f"output tokens each (greedy, EOS ignored); nanoserve weights: "
          f"{llm.engine.model_info.quantization}, transformers: float32; best of {args.repeats} "
          f"rounds each")
    print(f"{'sequences':>10} {'nanoserve tok/s':>16} {'transformers tok/s':>19} {'ratio':>7}")
    for i, ours_result in enumerate(ours):
        ref = f"{theirs[i].tokens_per_s:19.1f}" if theirs else f"{'-':>19}"
        ratio = f"{ours_result.tokens_per_s / theirs[i].tokens_per_s:6.2f}x" if theirs else "-"
        print(f"{ours_result.num_prompts:>10} {ours_result.tokens_per_s:16.1f} {ref} {ratio:>7}")

    if not args.skip_roofline:
        batch = args.num_prompts
        step = measure_decode_step(llm.engine, batch, args.input_len)
        runner = llm.engine.runner
        assert isinstance(runner, ModelRunner), "a benchmark runs a model (no zero-cost runner)"
        matmuls = measure_matmuls(runner.model, batch, args.input_len)
        print(f"\ndecode step at batch {batch}, context ~{args.input_len}: {step * 1e3:.1f} ms")
        print(f"  its matmuls alone: {matmuls.total * 1e3:.1f} ms (projections and LM head "
              f"{matmuls.projections * 1e3:.1f} ms, attention QK/PV {matmuls.attention * 1e3:.1f}"
              f" ms)")
        print(f"  step / matmuls = {step / matmuls.total:.2f}x "
              f"(step / projections alone = {step / matmuls.projections:.2f}x)")
    return 0

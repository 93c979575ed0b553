"""`nanoserve bench embed`: embedding throughput beside transformers on the same weights.

The same random-token inputs (all `--input-len` tokens, fresh each round so no prefix cache
helps) are embedded by nanoserve's engine (`LLM.embed`: prefill-only requests, continuously
batched and chunked, pooled as `--pooling` says) and by transformers (the GGUF's weights
dequantized to float32, the base model's final normed hidden states in static batches of
`--hf-batch-size`, pooled the same way, L2-normalized), in one run, the two taking turns; the
best round of each counts. Inputs/s and tokens/s are printed with their ratio, and the cosine
between the two engines' vectors of the same input (nanoserve's weights are the GGUF's own
quantized blocks by default, so they agree closely but not to the last bit).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch

from nanoserve.bench import LLMFactory, OfflineLLM
from nanoserve.bench.throughput import random_prompts, timed_load_transformers
from nanoserve.engine_args import EngineArgs


class EmbeddingLLM(OfflineLLM, Protocol):
    """What this benchmark uses of `nanoserve.LLM` besides generation."""

    def embed(self, prompts: Any, pooling_params: Any = None) -> list[Any]: ...


@dataclass
class Round:
    name: str
    num_inputs: int
    num_tokens: int
    seconds: float
    vectors: np.ndarray  # [num_inputs, hidden]

    @property
    def inputs_per_s(self) -> float:
        return self.num_inputs / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


def time_nanoserve(llm: EmbeddingLLM, prompts: list[list[int]]) -> Round:
    llm.embed([{"prompt_token_ids": prompts[0][:8]}])  # warm-up
    start = time.perf_counter()
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts])
    seconds = time.perf_counter() - start
    return Round("nanoserve", len(prompts), sum(map(len, prompts)), seconds,
                 np.stack([o.outputs.data for o in outs]))


@torch.inference_mode()
def time_transformers(model: Any, prompts: list[list[int]], pooling: str,
                      batch_size: int) -> Round:
    """Static batches of equal-length inputs (no padding), through the base model only (an
    embedding needs no LM head)."""
    def embed(ids: torch.Tensor) -> torch.Tensor:
        hidden = model.model(input_ids=ids).last_hidden_state  # [B, L, hidden]
        pooled = hidden[:, -1] if pooling == "last" else hidden.mean(1)
        return torch.nn.functional.normalize(pooled.float(), dim=-1)

    embed(torch.tensor([prompts[0][:8]]))  # warm-up
    start = time.perf_counter()
    vectors = [embed(torch.tensor(prompts[i : i + batch_size]))
               for i in range(0, len(prompts), batch_size)]
    seconds = time.perf_counter() - start
    return Round("transformers", len(prompts), sum(map(len, prompts)), seconds,
                 torch.cat(vectors).numpy())


def run_embed_bench(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    start = time.perf_counter()
    llm = cast(EmbeddingLLM, build_llm(engine_args))
    pooling = llm.engine.config.model.pooling
    print(f"nanoserve loaded {llm.engine.model_info.name} in {time.perf_counter() - start:.1f} s "
          f"({llm.engine.config.model.torch_device}, threads={torch.get_num_threads()}, "
          f"pooling={pooling}, weights={llm.engine.model_info.quantization})")
    reference = None if args.skip_transformers else timed_load_transformers(
        llm.engine.model_info.path)
    best: dict[str, Round] = {}
    agreement: list[float] = []
    for round_ in range(args.repeats):
        prompts = random_prompts(llm.tokenizer, args.num_inputs, args.input_len,
                                 seed=7000 + round_)
        rounds = [time_nanoserve(llm, prompts)]
        if reference is not None:
            rounds.append(time_transformers(reference, prompts, pooling, args.hf_batch_size))
            agreement += np.sum(rounds[0].vectors * rounds[1].vectors, axis=1).tolist()
        print(f"  round {round_ + 1}: " + ", ".join(
            f"{r.name} {r.inputs_per_s:.1f} inputs/s ({r.tokens_per_s:.0f} tok/s)"
            for r in rounds), flush=True)
        for r in rounds:
            if r.name not in best or r.seconds < best[r.name].seconds:
                best[r.name] = r
    _report(args, best, agreement)
    return 0


def _report(args: argparse.Namespace, best: dict[str, Round], agreement: list[float]) -> None:
    print(f"\n{args.num_inputs} inputs x {args.input_len} tokens, best of {args.repeats} "
          "rounds each")
    print(f"{'engine':>14} {'inputs/s':>10} {'tokens/s':>10}")
    for r in best.values():
        print(f"{r.name:>14} {r.inputs_per_s:10.1f} {r.tokens_per_s:10.0f}")
    if "transformers" in best:
        ratio = best["nanoserve"].inputs_per_s / best["transformers"].inputs_per_s
        print(f"{'ratio':>14} {ratio:9.2f}x")
        print(f"cosine(nanoserve, transformers) over {len(agreement)} inputs: "
              f"mean {np.mean(agreement):.6f}, min {np.min(agreement):.6f}")

"""`nanoserve bench structured`: what structured outputs cost the engine, each figure beside its
unconstrained peer measured in the same run.

1. Throughput: a batch of 32 random-token prompts, greedy; half of them follow a JSON schema
   (four schemas, each an array too long to finish within --output-len, so every request makes
   exactly --output-len tokens), beside the same batch with no schema. Runs alternate (A B A B)
   and the medians are compared.
2. Compile time per schema: cold (a compiler that caches nothing, its tokenizer already built)
   and cached (the future handed back by the cache), medians over --repeats.
3. Inter-token latency of free requests while a large schema compiles: one free batch decodes,
   its steps dealt in turns of 10 to three variants: nothing else, a compile of a new
   1,200-property schema always in flight on the engine's grammar worker (submitted the way
   `add_request` does, but never added, so the batch stays the same), and the same on a worker
   at the step loop's priority (nice 0); each variant's per-step p50 and p99.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from nanoserve.bench import LLMFactory
from nanoserve.engine.core import EngineCore
from nanoserve.engine_args import EngineArgs
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.structured.grammar import WORKER_NICE, GrammarCompiler

NAME = {"type": "string", "maxLength": 24}


def _closed(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


ITEM_SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _closed({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"}}),
    "order": _closed({"sku": {"type": "string", "pattern": "^SKU-[0-9]{4}$"},
                      "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                      "status": {"enum": ["new", "paid", "shipped"]}}),
    "point": _closed({"x": {"type": "number"}, "y": {"type": "number"},
                      "label": {"anyOf": [NAME, {"type": "null"}]}}),
    "event": _closed({"title": NAME, "tags": {"type": "array", "items": NAME, "maxItems": 3},
                      "day": {"type": "integer", "minimum": 1, "maximum": 31}}),
}


def large_schema(tag: int, num_objects: int = 60, num_fields: int = 20) -> dict[str, Any]:
    """num_objects x num_fields properties; `tag` makes its content (and cache key) new."""
    return {"type": "object", "title": f"large-{tag}", "additionalProperties": False,
            "properties": {f"object_{i}": {"type": "object", "properties": {
                f"field_{j}": {"type": ["string", "integer", "null"], "maxLength": 20}
                for j in range(num_fields)}} for i in range(num_objects)}}


def long_array(item: dict[str, Any]) -> dict[str, Any]:
    """An array of `item`s that cannot close within a benchmark's output length."""
    return {"type": "array", "items": item, "minItems": 500, "maxItems": 500}


def run_structured_bench(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    start = time.perf_counter()
    llm = build_llm(engine_args)
    engine = llm.engine
    print(f"loaded {engine.model_info.name} in {time.perf_counter() - start:.1f} s "
          f"(quantization {engine.model_info.quantization}); medians of {args.repeats} "
          "alternating runs")
    parts = args.parts.split(",")
    if "compile" in parts:
        _report_compile_times(engine, args.repeats)
    if "throughput" in parts:
        _report_throughput(engine, args)
    if "itl" in parts:
        _report_itl(engine, args)
    return 0


# -- 2) compile times ---------------------------------------------------------------------------
def _report_compile_times(engine: EngineCore, repeats: int) -> None:
    loaded = engine.model_info
    cold = GrammarCompiler(loaded.tokenizer, loaded.arch.vocab_size, loaded.eos_token_ids,
                           max_cached=0)
    warm_up = time.perf_counter()
    cold.compile(StructuredOutputsParams(regex="a"))  # builds llguidance's tokenizer, once
    print(f"\ngrammar compiler set-up (llguidance's tokenizer, once per engine, on the worker): "
          f"{time.perf_counter() - warm_up:.2f} s")
    cached = engine.structured.compiler
    cases = {name: StructuredOutputsParams(json=schema)
             for name, schema in ITEM_SCHEMAS.items()}
    cases["large (1,200 properties)"] = StructuredOutputsParams(json=large_schema(0))
    cases["regex (email)"] = StructuredOutputsParams(regex=r"[a-z]{1,12}@[a-z]{1,12}\.com")
    cases["choice (3)"] = StructuredOutputsParams(choice=["positive", "negative", "neutral"])
    print(f"{'grammar':<26} {'cold ms':>9} {'cached µs':>10}")
    for name, params in cases.items():
        cached.compile(params)
        cold_s, cached_s = [], []
        for _ in range(repeats):  # alternate, so load on the machine hits both alike
            cold_s.append(_compile_seconds(cold, params))
            cached_s.append(_compile_seconds(cached, params))
        print(f"{name:<26} {statistics.median(cold_s) * 1e3:9.2f} "
              f"{statistics.median(cached_s) * 1e6:10.1f}")
    cold.close()


def _compile_seconds(compiler: GrammarCompiler, params: StructuredOutputsParams) -> float:
    """Wall time from submitting to holding the compiled grammar (what a request waits)."""
    start = time.perf_counter()
    compiler.compile(params)
    return time.perf_counter() - start


# -- 1) throughput ------------------------------------------------------------------------------
def _report_throughput(engine: EngineCore, args: argparse.Namespace) -> None:
    rng = np.random.default_rng(1)
    vocab = engine.model_info.arch.vocab_size
    prompts = [rng.integers(3, vocab, args.input_len).tolist() for _ in range(args.batch)]
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    items = list(ITEM_SCHEMAS.values())
    half = [free if i % 2 else SamplingParams(
        temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=long_array(items[i // 2 % len(items)])))
        for i in range(args.batch)]
    batches = {"unconstrained": [free] * args.batch, "half constrained": half}
    for batch in batches.values():  # warm-up: compiles, allocator, kernels
        _tokens_per_second(engine, prompts[:4], batch[:4])
    runs: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(args.repeats):
        for name, batch in batches.items():
            runs[name].append(_tokens_per_second(engine, prompts, batch))
    base = statistics.median(runs["unconstrained"])
    print(f"\n{args.batch} prompts x {args.input_len} tokens -> {args.output_len} tokens each, "
          f"greedy; half constrained: every other request follows one of {len(items)} JSON "
          "schemas")
    print(f"{'batch':<18} {'output tok/s':>13} {'ratio':>7}   runs")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"{name:<18} {median:13.1f} {median / base:6.2f}x   "
              + " ".join(f"{v:.1f}" for v in values))


def _tokens_per_second(engine: EngineCore, prompts: list[list[int]],
                       params: list[SamplingParams]) -> float:
    """Output tokens per second of one batch run to completion in the engine core."""
    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"tput-{i}", prompt, p)
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    return num_tokens / (time.perf_counter() - start)


# -- 3) inter-token latency while a large schema compiles ---------------------------------------
Submit = Callable[[StructuredOutputsParams], "Future[Any]"]  # starts a compile
BLOCK_STEPS = 10  # steps per block; blocks of the variants take turns


def _report_itl(engine: EngineCore, args: argparse.Namespace) -> None:
    loaded = engine.model_info
    at_nice_0 = GrammarCompiler(loaded.tokenizer, loaded.arch.vocab_size, loaded.eos_token_ids,
                                worker_nice=0)
    at_nice_0.compile(StructuredOutputsParams(regex="a"))  # its tokenizer, before timing

    def engine_compile(params: StructuredOutputsParams) -> Future[Any]:  # as add_request does
        return engine.structured.grammar_for(params).compiled

    variants: dict[str, Submit | None] = {
        "free only": None, f"compiling (worker nice {WORKER_NICE})": engine_compile,
        "compiling (nice 0)": at_nice_0.submit}
    times, compiles = _interleaved_step_times(engine, args, variants)
    at_nice_0.close()
    print(f"\n{args.itl_batch} free requests decoding, {args.itl_steps} steps per variant in "
          f"alternating blocks of {BLOCK_STEPS}: alone, and with a new 1,200-property schema "
          "always compiling on a grammar worker")
    base_p99 = float(np.percentile(times["free only"], 99))
    print(f"{'':<28} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'p99 ratio':>10} {'compiles':>9}")
    for name, seconds in times.items():
        p50, p99 = np.percentile(seconds, 50) * 1e3, float(np.percentile(seconds, 99))
        print(f"{name:<28} {p50:11.1f} {p99 * 1e3:11.1f} {p99 / base_p99:9.2f}x "
              f"{compiles[name]:9d}")


def _interleaved_step_times(engine: EngineCore, args: argparse.Namespace,
                            variants: dict[str, Submit | None]
                            ) -> tuple[dict[str, list[float]], dict[str, int]]:
    """One free batch decodes; its steps go to the variants in turn, BLOCK_STEPS at a time (so
    the machine's other load falls on all alike). In a variant's block a compile of a schema
    never seen before is always in flight; it is finished, untimed, before the next block."""
    vocab = engine.model_info.arch.vocab_size
    rng = np.random.default_rng(0)
    num_steps = args.itl_steps * len(variants)
    free = SamplingParams(temperature=0.0, max_tokens=num_steps + 2, ignore_eos=True)
    ids = [f"itl-{i}" for i in range(args.itl_batch)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(3, vocab, args.input_len).tolist(), free)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill first: only decode steps are timed
    times: dict[str, list[float]] = {name: [] for name in variants}
    compiles = dict.fromkeys(variants, 0)
    tag = 0
    for block in range(num_steps // BLOCK_STEPS):
        name = list(variants)[block % len(variants)]
        submit, future = variants[name], None
        for _ in range(BLOCK_STEPS):
            grammar = None
            if submit is not None and (future is None or future.done()):
                compiles[name] += future is not None
                tag += 1  # a new schema each time: a cold compile
                grammar = StructuredOutputsParams(json=large_schema(tag))
            start = time.perf_counter()  # the submit is timed: add_request runs it in the loop
            if submit is not None and grammar is not None:
                future = submit(grammar)
            engine.step()
            times[name].append(time.perf_counter() - start)
        if future is not None:
            future.result()
    for request_id in ids:
        engine.abort(request_id)
    return times, compiles

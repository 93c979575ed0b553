"""EngineCore: schedule -> run -> sample -> update, one step at a time, with no I/O.

It runs in-process under tests and in `LLM`; the server wraps it in its own process.
Structured outputs (`nanoserve/structured/`) add three things, each in its own method: a
grammar compile started at `add_request`, compiles that failed finished before scheduling, and
the grammar bitmask on the constrained logits rows right before the sampler.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from nanoserve.config import EngineConfig, GiB
from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.memory import keep_freed_memory_in_heap
from nanoserve.engine.model_runner import (
    ModelRunner,
    kv_bytes_per_block,
    resolve_kv_cache_dtype,
)
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.scheduler import ScheduledRequest, Scheduler
from nanoserve.engine.zero_cost_runner import ZeroCostRunner
from nanoserve.model.loader import LoadedModel, load_model
from nanoserve.protocol import EngineCoreOutput, SchedulerStats
from nanoserve.sample.logits_processor import load_processor_classes
from nanoserve.sample.logprobs import prompt_logprobs
from nanoserve.sample.sampler import Sampler
from nanoserve.sample.sequence import SequenceData
from nanoserve.sample.state import ReasoningTokens
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)
# Touching the cache's pages at start-up costs ~1.5 s per GiB on a small VM; 1 GiB holds
# ~23,000 tokens of the default model in float32 (~46,000 in the float16 cache that quantized
# weights get), more than a CPU serves at once.
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB
GPU_MEMORY_FRACTION = 0.9
# With only compiling requests left, how long a step waits for a compile to finish: short, so
# new inputs are not held up, and not a spin that takes the core the compile runs on.
GRAMMAR_WAIT_S = 0.005


class EngineCore:
    """The continuous-batching engine: `add_request`, `step`, `abort`, `has_unfinished`."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        device, dtype = config.model.torch_device, config.model.torch_dtype
        keep_freed_memory_in_heap()
        if loaded is None:
            loaded = load_model(config.model.model, device, dtype, config.model.max_model_len,
                                config.model.quantization)
        self.loaded = loaded
        block_size = config.cache.block_size
        kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, loaded.quantization,
                                          device, dtype)
        num_blocks = config.cache.num_blocks or self._blocks_for_budget(block_size, kv_dtype,
                                                                         device)
        self.max_model_len = self._max_model_len(num_blocks * block_size)
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len)
        self.runner: ModelRunner | ZeroCostRunner = ModelRunner(
            loaded.model, num_blocks, block_size, device, kv_dtype,
            num_slots=config.scheduler.max_num_seqs, max_model_len=self.max_model_len)
        if config.model.zero_cost_runner:
            self.runner = ZeroCostRunner(self.runner, config.scheduler.max_num_seqs)
        self.sampler = Sampler(
            config.scheduler.max_num_seqs, loaded.arch.vocab_size, device, loaded.eos_token_ids,
            reasoning_tokens(loaded.tokenizer),
            load_processor_classes(config.sampler.logits_processors))
        self.seed_rng = random.Random(config.model.seed)
        self.structured = StructuredOutputManager(
            loaded.tokenizer, loaded.arch.vocab_size, loaded.eos_token_ids,
            config.scheduler.max_num_seqs, device)
        self.compiling: dict[str, Request] = {}  # requests whose grammar is compiling
        self.stats = SchedulerStats()  # brought up to date by every step and abort
        # Everything loaded so far (the model, the tokenizer, the imported libraries: millions
        # of objects) lives as long as the engine: moved out of the collector's sight, the
        # oldest-generation collections that steps trigger no longer walk it (vLLM does the
        # same). Measured: the collector took ~2% of the engine thread in `bench throughput`.
        gc.collect()
        gc.freeze()

    def _blocks_for_budget(self, block_size: int, dtype: torch.dtype,
                           device: torch.device) -> int:
        budget = self.config.cache.kv_cache_memory_bytes
        if budget is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * GPU_MEMORY_FRACTION)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        return max(1, budget // kv_bytes_per_block(self.loaded.arch, block_size, dtype))

    def _max_model_len(self, cache_tokens: int) -> int:
        arch = self.loaded.arch
        wanted = self.config.model.max_model_len
        limit = arch.max_position_embeddings
        if arch.sliding_window:
            limit = min(limit, arch.sliding_window)  # beyond it, full attention would differ
        if wanted is not None:
            if wanted > limit:
                raise ValueError(f"max_model_len={wanted} exceeds the model's context of {limit}")
            if wanted > cache_tokens:
                raise ValueError(
                    f"max_model_len={wanted} does not fit the KV cache ({cache_tokens} tokens); "
                    "give the cache more memory or lower max_model_len")
            return wanted
        return min(limit, cache_tokens)

    # -- the interface ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, prefill_leader: str | None = None) -> Request:
        """Queue a request; raises ValueError if it can never run (too long, empty).

        `prefill_leader` names a request with the same prompt (an earlier sample of an n > 1
        request): this one is admitted once the leader's prompt blocks are in the cache.
        """
        request = Request(request_id, prompt_token_ids, params, self.loaded.eos_token_ids)
        if prefill_leader is not None:
            request.prefill_leader = self.scheduler.requests.get(prefill_leader)
        vocab = self.loaded.arch.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        params.check_token_ids(vocab)
        cap = self.config.sampler.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > cap:
                raise ValueError(f"{name} must be <= {cap} (the server's max_logprobs), "
                                 f"got {asked}")
        self.sampler.validate(params)
        request.sampling_seed = (params.seed if params.seed is not None
                                 else self.seed_rng.getrandbits(64))
        if params.structured_outputs is not None:
            request.grammar = self.structured.grammar_for(params.structured_outputs)
        self.scheduler.add_request(request)
        if request.grammar is not None and not request.grammar.is_ready:
            self.compiling[request_id] = request
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request and free everything it holds; False if it was not in the engine."""
        was_in_engine = self.scheduler.abort(request_id) is not None
        self._update_stats()
        return was_in_engine

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        """Advance every running request by one forward pass; outputs for those that sampled."""
        # The nanoserve.* scopes let `nanoserve bench step` split the step's time (a few µs).
        with record_function("nanoserve.step"):
            return self._step()

    def _step(self) -> list[EngineCoreOutput]:
        # 1) schedule; slots freed since the last step are cleared before new ones are written
        failed = self._finish_failed_grammars()
        sched = self.scheduler.schedule()
        for slot in self.scheduler.released_slots:
            self.sampler.remove_request(slot)
            self.runner.release_slot(slot)
        self.scheduler.released_slots.clear()
        if not sched.scheduled:
            self._wait_for_grammars()
            return failed
        for request in sched.admitted:
            assert request.slot is not None
            self.sampler.add_request(SequenceData(
                request.slot, request.params, request.prompt_token_ids,
                request.output_token_ids, request.sampling_seed))
        # 2) run the model
        block_ids = [self.kv_cache.block_ids(s.request.request_id) for s in sched.scheduled]
        with record_function("nanoserve.model"):
            logits, prompt_logits = self.runner.execute(sched.scheduled, block_ids)
        self._collect_prompt_logprobs(sched.scheduled, prompt_logits)
        # 3) sample
        sampling = [s.request for s in sched.scheduled if s.samples]
        start = time.perf_counter()
        slots = np.fromiter((r.slot for r in sampling), dtype=np.int64, count=len(sampling))
        self._apply_grammars(logits, sampling)
        with record_function("nanoserve.sample"):
            sampled = self.sampler.sample(logits, self.sampler.make_batch(slots))
        self.stats.sample_seconds += time.perf_counter() - start
        # 4) update requests, finish those that stop
        self.scheduler.update_after_step(sched, sampled.token_ids)
        self._update_stats(sched.num_tokens)
        outputs = failed
        for request, logprobs in zip(sampling, sampled.logprobs, strict=True):
            first = request.num_output_tokens == 1
            outputs.append(EngineCoreOutput(
                request.request_id, [request.output_token_ids[-1]],
                request.status.finish_reason, request.stop_reason, request.num_cached_tokens,
                None if logprobs is None else [logprobs],
                request.prompt_logprobs if first and request.params.prompt_logprobs is not None
                else None))
        return outputs

    # -- structured outputs ---------------------------------------------------------------------
    def _apply_grammars(self, logits: torch.Tensor, sampling: list[Request]) -> None:
        """The grammar bitmask on the rows of requests with a grammar (logits: [R, vocab], one
        row per sampling request); free rows are untouched."""
        grammars = [request.grammar for request in sampling]
        if any(grammar is not None for grammar in grammars):
            with record_function("nanoserve.grammar"):
                self.structured.apply_bitmask(logits, grammars)

    def _finish_failed_grammars(self) -> list[EngineCoreOutput]:
        """Forget finished compiles; finish (with "error") the requests whose compile failed.
        The entry points check grammars before adding them, so this is rare."""
        outputs = []
        for request_id, request in list(self.compiling.items()):
            grammar = request.grammar
            if grammar is None or request.is_finished:  # aborted while compiling
                del self.compiling[request_id]
            elif not grammar.is_compiling:
                del self.compiling[request_id]
                if grammar.failure is not None:
                    logger.warning("request %s: %s", request_id, grammar.failure)
                    self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
                    outputs.append(EngineCoreOutput(request_id, [], "error"))
        if outputs:
            self._update_stats()
        return outputs

    def _wait_for_grammars(self) -> None:
        """Nothing could run: if compiles are what the waiting requests wait for, sleep until
        one is done (or a few ms) instead of spinning."""
        grammars = [r.grammar for r in self.compiling.values() if r.grammar is not None]
        if grammars:
            self.structured.wait_for_any(grammars, GRAMMAR_WAIT_S)

    def _collect_prompt_logprobs(self, scheduled: list[ScheduledRequest],
                                 prompt_logits: dict[int, torch.Tensor]) -> None:
        for i, logits in prompt_logits.items():
            s = scheduled[i]
            request = s.request
            done = len(request.prompt_logprobs)  # positions already computed (recompute safe)
            first = max(s.start, done)
            rows = logits[first - s.start :]
            targets = request.prompt_token_ids[first + 1 : first + 1 + rows.shape[0]]
            if targets:
                request.prompt_logprobs += prompt_logprobs(
                    rows, targets, request.params.prompt_logprobs or 0)

    def _update_stats(self, num_computed_tokens: int = 0) -> None:
        """The gauges as they are now; the counters, plus this step's computed tokens."""
        stats, scheduler, kv_cache = self.stats, self.scheduler, self.kv_cache
        stats.num_running, stats.num_waiting = len(scheduler.running), len(scheduler.waiting)
        stats.kv_cache_usage = kv_cache.usage
        stats.kv_blocks_in_use = kv_cache.num_blocks - kv_cache.num_free_blocks
        stats.prefix_cache_queries = kv_cache.prefix_cache_queries
        stats.prefix_cache_hits = kv_cache.prefix_cache_hits
        stats.num_preemptions = scheduler.num_preemptions
        stats.num_computed_tokens += num_computed_tokens


def reasoning_tokens(tokenizer: Any) -> ReasoningTokens | None:
    """`<think>` / `</think>` when the vocabulary has each as one token (Qwen3, DeepSeek-R1)."""
    vocab = tokenizer.get_vocab()
    start, end = vocab.get("<think>"), vocab.get("</think>")
    return ReasoningTokens(start, end) if start is not None and end is not None else None

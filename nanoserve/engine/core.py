"""EngineCore: schedule -> run -> sample -> update, one step at a time, with no I/O.

It runs in-process under tests and in `LLM`; the server wraps it in its own process. The core
owns the requests: the scheduler, the KV cache's blocks, the grammars. Each step it turns the
scheduler's choice into a data-only `StepInput` (step_input.py) and hands it to its executor,
whose worker runs the forward and the sampler (worker.py); the tokens that come back are
committed, one per request, or 1 + the accepted draft tokens when a proposer drafts.
Structured outputs (`nanoserve/structured/`) add three things, each in its own method: a
grammar compile started at `add_request`, compiles that failed finished before scheduling, and
the grammar bitmask of the constrained rows, filled here and applied by the worker.
Pooling requests (prefill only: embeddings, scores) sample nothing; the step that completes
one's prompt finishes it and hands out its vector (`_finish_pooling`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence

import numpy as np

from nanoserve.config import (
    ALLOW_LONG_MAX_MODEL_LEN,
    EngineConfig,
    allow_long_max_model_len,
    check_priority,
)
from nanoserve.engine.block_table import BlockTable
from nanoserve.engine.drafts import (
    hand_over_finished,
    hand_over_step_drafts,
    load_draft_proposer,
    propose_drafts,
    record_drafts,
)
from nanoserve.engine.executor import Executor
from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.prefill_pacer import PrefillPacer, tokens_per_unit_of_context
from nanoserve.engine.prompt_progress import prompt_progress
from nanoserve.engine.request import Request, RequestStatus
from nanoserve.engine.request_images import attach_images
from nanoserve.engine.scheduler import ScheduledRequest, Scheduler
from nanoserve.engine.state_plan import draft_states_for, plan_states, state_snapshots_for
from nanoserve.engine.step_input import build_step_input
from nanoserve.engine.zero_cost_runner import ZeroCostRunner
from nanoserve.model.kv_groups import kv_layer_groups
from nanoserve.model.loader import ModelInfo
from nanoserve.pooling_params import PoolingParams
from nanoserve.profiling import scope
from nanoserve.protocol import (
    EngineCoreOutput,
    ImageInput,
    NewSequence,
    SchedulerStats,
    StepInput,
    StepOutput,
    TokenLogprobs,
)
from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sample.admission import SamplingAdmission
from nanoserve.sample.logits_processor import load_processor_classes
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# With only compiling requests left, how long a step waits for a compile to finish: short, so
# new inputs are not held up, and not a spin that takes the core the compile runs on.
GRAMMAR_WAIT_S = 0.005
NO_GRAMMAR_ROWS = np.zeros(0, dtype=np.int64)
NO_GRAMMAR_BITMASK = np.zeros((0, 0), dtype=np.int32)


class EngineCore:
    """The continuous-batching engine: `add_request`, `step`, `abort`, `has_unfinished`.
    Built by `engine/build.py`'s `build_engine_core`, which starts its executor's workers."""

    def __init__(self, config: EngineConfig, executor: Executor, model_info: ModelInfo,
                 num_blocks: int) -> None:
        """`executor` runs each step on the workers (their KV caches hold `num_blocks`
        blocks; their runners hold the weights); `model_info` is what the core reads of the
        model: the vocabulary, the EOS ids, the tokenizer for the grammars."""
        self.config = config
        self.executor = executor
        self.model_info = model_info
        block_size = config.cache.block_size
        groups = kv_layer_groups(model_info.arch)
        self.max_model_len = self._max_model_len(groups.tokens_held(num_blocks, block_size))
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                                       record_events=config.kv_events.enable_kv_cache_events,
                                       group_windows=groups.windows)
        self.state_snapshots = state_snapshots_for(config, model_info.arch, num_blocks)
        if self.state_snapshots is not None:
            self.kv_cache.keep_state_snapshots(self.state_snapshots)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len,
                                   self._pacer(config, model_info))
        # every running request's blocks by slot; a step's block table is read from it
        num_slots = config.scheduler.max_num_seqs
        self.block_tables = [BlockTable(num_slots, -(-self.max_model_len // block_size))
                             for _ in groups.windows]  # one per KV layer group
        self.block_table = self.block_tables[0]
        self.proposer = load_draft_proposer(config.scheduler.draft_proposer)
        # a hybrid's verify chunks keep their DeltaNet states per draft (engine/draft_states.py)
        self.draft_states = draft_states_for(config, model_info.arch, num_blocks)
        reasoning = ReasoningTokens.of(model_info.tokenizer)
        # the sampler lives in rank 0's worker; the core admits with the same checks
        self.admission = SamplingAdmission(
            model_info.eos_token_ids, reasoning is not None,
            tuple(load_processor_classes(config.sampler.logits_processors)))
        self.seed_rng = random.Random(config.model.seed)
        self.structured = StructuredOutputManager(
            model_info.tokenizer, model_info.arch.vocab_size, model_info.eos_token_ids,
            self.max_sampled_rows(config), config.model.torch_device, reasoning)
        self.compiling: dict[str, Request] = {}  # requests whose grammar is compiling
        self.kernel_schedule = ""  # the CPU kernels' schedule in one line (kernel_tuning/)
        self.stats = SchedulerStats()  # brought up to date by every step and abort

    @staticmethod
    def _pacer(config: EngineConfig, model_info: ModelInfo) -> PrefillPacer | None:
        factor = config.scheduler.prefill_pacing
        if not factor:
            return None
        arch = model_info.arch
        return PrefillPacer(factor, tokens_per_unit_of_context(
            arch.hidden_size, arch.active_intermediate_size, arch.num_layers, arch.num_heads,
            arch.num_kv_heads, arch.head_dim))

    @staticmethod
    def max_sampled_rows(config: EngineConfig) -> int:
        """The rows a step can sample: a row per slot, and each slot's drafts when a proposer
        drafts."""
        drafts = (config.scheduler.num_speculative_tokens
                  if config.scheduler.draft_proposer is not None else 0)
        return config.scheduler.max_num_seqs * (1 + drafts)

    def _max_model_len(self, cache_tokens: int) -> int:
        arch = self.model_info.arch
        wanted = self.config.model.max_model_len
        limit = arch.max_position_embeddings  # a sliding window is attended as it is, no cap
        if wanted is not None:
            if wanted > limit and not allow_long_max_model_len():
                raise ValueError(
                    f"max_model_len={wanted} exceeds the model's context of {limit}; set "
                    f"{ALLOW_LONG_MAX_MODEL_LEN}=1 to run past it anyway (positions past the "
                    "model's training give outputs it was never taught; benchmarks use it)")
            if wanted > cache_tokens:
                raise ValueError(
                    f"max_model_len={wanted} does not fit the KV cache ({cache_tokens} tokens); "
                    "give the cache more memory or lower max_model_len")
            return wanted
        return min(limit, cache_tokens)

    @property
    def runner(self) -> ModelRunner | ZeroCostRunner:
        """The in-process worker's model runner (tests and benches read its model and cache)."""
        return self.executor.local_worker.runner

    def shutdown(self) -> None:
        """Every cached block onto the disk tier where there is one (a restart or a router's
        reload finds them); then stop the workers of other processes (tensor parallelism)."""
        try:
            self.kv_cache.close_disk_tier()
        finally:
            self.executor.shutdown()

    # -- the interface ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, prefill_leader: str | None = None,
                    pooling_params: PoolingParams | None = None, tenant: str = "",
                    images: Sequence[ImageInput] = ()) -> Request:
        """Queue a request; raises ValueError if it can never run (too long, empty).

        `prefill_leader` names a request with the same prompt (an earlier sample of an n > 1
        request): this one is admitted once the leader's prompt blocks are in the cache.
        With `pooling_params` the request is prefill only: it samples nothing (`params` is not
        read) and comes back as one output with its vector in `pooled` (see `_finish_pooling`).
        `tenant`: who sent it (the digest of its API key), for proposers that learn across
        requests. `images`: the prompt's images, their placeholder tokens in the prompt
        (model/vision/); each is computed in one step, so it must fit the step's budget.
        """
        if pooling_params is not None:
            pooling_params.check(self.model_info.arch.hidden_size,
                                 self.model_info.arch.vocab_size)
            params = SamplingParams(max_tokens=1)  # never read: a pooling request samples nothing
        request = Request(request_id, prompt_token_ids, params, self.model_info.eos_token_ids,
                          pooling_params, self.config.model.pooling)
        request.tenant = tenant
        if images:
            attach_images(request, images, self.model_info,
                          self.config.scheduler.max_num_batched_tokens)
        if prefill_leader is not None:
            request.prefill_leader = self.scheduler.requests.get(prefill_leader)
        vocab = self.model_info.arch.vocab_size
        # (an image's placeholder id may lie past the text vocabulary: Gemma 3's does)
        bad = [t for i, t in enumerate(prompt_token_ids)
               if not 0 <= t < vocab and not any(m.offset <= i < m.end for m in images)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        if pooling_params is None:
            self._check_sampling(params)
            # (not drawn for a pooling request: the unseeded requests after it keep their seeds)
            request.sampling_seed = (params.seed if params.seed is not None
                                     else self.seed_rng.getrandbits(64))
        if params.structured_outputs is not None:
            request.grammar = self.structured.grammar_for(params.structured_outputs)
        self.scheduler.add_request(request)
        if request.grammar is not None and not request.grammar.is_ready:
            self.compiling[request_id] = request
        return request

    def _check_sampling(self, params: SamplingParams) -> None:
        """Refuse what the sampler cannot do, with the API's checks and words (the API server
        ran them already; a client of the engine's own has not)."""
        params.check_limits(self.model_info.arch.vocab_size, self.config.sampler.max_logprobs)
        check_priority(params.priority, self.config.scheduler.scheduling_policy)
        self.admission.check(params)

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
        with scope("nanoserve.step"):
            return self._step()

    def _step(self) -> list[EngineCoreOutput]:
        # 1) schedule
        failed = self._finish_failed_grammars()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            self._wait_for_grammars()
            return failed
        # 2) the step as data: slots freed since the last step are cleared before new ones
        released = list(self.scheduler.released_slots)
        self.scheduler.released_slots.clear()
        for slot in released:
            for table in self.block_tables:
                table.clear(slot)
        for s in sched.scheduled:
            assert s.request.slot is not None, "a scheduled request holds a slot"
            for group, table in enumerate(self.block_tables):
                table.sync(s.request.slot, self.kv_cache.block_ids(s.request.request_id, group))
        sampling = [s for s in sched.scheduled if s.samples]
        step = build_step_input(
            sched.scheduled, self.block_table, self.kv_cache.block_size,
            [NewSequence(r.slot, r.params, r.prompt_token_ids, list(r.output_token_ids),
                         r.sampling_seed, r.mirostat_mu) for r in sched.admitted
             if r.slot is not None and not r.is_pooling],
            released, self._fill_grammars(sampling), self.block_tables[1:],
            self.model_info.arch.attends_images_both_ways)
        if self.model_info.arch.linear is not None:
            plan_states(sched, step, self.state_snapshots, self.kv_cache, self.draft_states)
        # 3) run the model and sample, on the workers
        started = time.perf_counter()
        out = self.executor.execute_step(step)
        if self.scheduler.pacer is not None:
            self.scheduler.pacer.observe(sched.num_decodes, sched.prompt_units,
                                         time.perf_counter() - started)
        self.stats.sample_seconds += out.sample_seconds
        self._collect_prompt_logprobs(sched.scheduled, step, out)
        refusing = set(out.draft_refusing_slots)
        if refusing or out.mirostat_mu:  # what the worker's sampler says of its slots
            for request in (s.request for s in sched.scheduled):
                held = request.slot
                assert held is not None, "a scheduled request holds a slot"
                request.refuses_drafts |= held in refusing
                request.mirostat_mu = out.mirostat_mu.get(held, request.mirostat_mu)
        # 4) commit each request's tokens (1 + its accepted drafts), finish those that stop
        first_rows = np.cumsum(step.num_sample_rows) - step.num_sample_rows  # [requests]
        new_token_ids = [out.sampled_token_ids[row : row + taken]
                         for row, taken in zip(first_rows.tolist(), out.num_accepted, strict=True)]
        committed = self.scheduler.update_after_step(sched, new_token_ids)
        if self.draft_states is not None:
            self.draft_states.commit(sampling, out.num_accepted, self.state_snapshots,
                                     self.kv_cache)
        record_drafts(self.stats, [s.request for s in sampling],
                      [len(s.draft_token_ids) for s in sampling], out.num_accepted)
        if self.proposer is not None:
            hand_over_finished(self.proposer, [s.request for s in sampling])
            hand_over_step_drafts(self.proposer, [s.request for s in sampling],
                                  out.draft_token_ids)
        self._update_stats(sched.num_tokens)
        outputs = failed
        for s, tokens, row in zip(sampling, committed, first_rows.tolist(), strict=True):
            outputs.append(self._output(s.request, tokens, out.logprobs[row : row + len(tokens)]))
        if step.pooling:
            outputs += self._finish_pooling(sched.scheduled, step, out)
        outputs += prompt_progress(sched.scheduled, outputs, started)
        self.stats.num_steps += 1
        start = time.perf_counter()
        self._propose_drafts()
        self.stats.propose_seconds += time.perf_counter() - start
        return outputs

    def _finish_pooling(self, scheduled: list[ScheduledRequest], step: StepInput,
                        out: StepOutput) -> list[EngineCoreOutput]:
        """Pooling requests whose prompt this step completed: finished (their blocks and
        slots freed, nothing kept), each handed out with its vector and no tokens."""
        done = [entry for entry in step.pooling if entry.is_last]
        outputs = []
        for entry, vector in zip(done, out.pooled, strict=True):
            request = scheduled[entry.request_index].request
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(request.request_id, [], "stop", None,
                                            request.num_cached_tokens, pooled=vector))
        self._update_stats()
        return outputs

    def _output(self, request: Request, tokens: list[int],
                logprobs: list[TokenLogprobs | None]) -> EngineCoreOutput:
        is_first = request.num_output_tokens == len(tokens)
        return EngineCoreOutput(
            request.request_id, tokens, request.status.finish_reason, request.stop_reason,
            request.num_cached_tokens,
            None if not logprobs or logprobs[0] is None else logprobs,  # type: ignore[arg-type]
            request.prompt_logprobs if is_first and request.params.prompt_logprobs is not None
            else None)

    # -- draft tokens -----------------------------------------------------------------------------
    def _propose_drafts(self) -> None:
        """Ask the proposer for each running request's next draft tokens (if one is set),
        only where a step stays cheap (drafts.py: `propose_drafts`)."""
        if self.proposer is None:
            return
        scheduler, config = self.scheduler, self.config.scheduler
        propose_drafts(self.proposer, scheduler.running, bool(scheduler.waiting),
                       config.num_speculative_tokens, config.speculative_max_rows,
                       self.max_model_len, self.structured.valid_drafts)

    # -- structured outputs ---------------------------------------------------------------------
    def _fill_grammars(self, sampling: list[ScheduledRequest]) -> tuple[np.ndarray, np.ndarray]:
        """The grammar bitmask of the sampled rows with a grammar: one row per sampled
        position, a window's row j after its matcher took the j drafts before it."""
        if all(s.request.grammar is None for s in sampling):
            return NO_GRAMMAR_ROWS, NO_GRAMMAR_BITMASK
        with scope("nanoserve.grammar"):
            return self.structured.fill_bitmask(
                [(s.request.grammar, s.draft_token_ids) for s in sampling])

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

    @staticmethod
    def _collect_prompt_logprobs(scheduled: list[ScheduledRequest], step: StepInput,
                                 out: StepOutput) -> None:
        for entry, logprobs in zip(step.prompt_logprobs, out.prompt_logprobs, strict=True):
            scheduled[entry.request_index].request.prompt_logprobs += logprobs

    def _update_stats(self, num_computed_tokens: int = 0) -> None:
        """The gauges as they are now; the counters, plus this step's computed tokens."""
        stats, scheduler, kv_cache = self.stats, self.scheduler, self.kv_cache
        stats.num_running, stats.num_waiting = len(scheduler.running), len(scheduler.waiting)
        stats.kv_cache_usage = kv_cache.usage
        stats.kv_blocks_in_use = kv_cache.num_blocks - kv_cache.num_free_blocks
        stats.prefix_cache_queries = kv_cache.prefix_cache_queries
        stats.prefix_cache_hits = kv_cache.prefix_cache_hits
        if kv_cache.disk is not None:
            disk = kv_cache.disk.stats
            stats.kv_disk_hits, stats.kv_disk_misses = disk.hits, disk.misses
            stats.kv_disk_bytes_read = disk.bytes_read
            stats.kv_disk_bytes_written = disk.bytes_written
        stats.num_preemptions = scheduler.num_preemptions
        stats.num_computed_tokens += num_computed_tokens


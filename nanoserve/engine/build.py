"""One call builds a ready engine core for a model config (`build_engine_core`): the executor
and its workers first (tensor-parallel ranks started, every rank's model and cache built the
same way, `rank_build.py`), then the core that schedules over them.

The core receives its executor and never chooses one, so what runs the steps (this process, or
N ranks in others) is decided here alone; the `LLM` class, the engine-core process and the
tests all build through this function.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from nanoserve.config import EngineConfig
from nanoserve.engine.core import EngineCore
from nanoserve.engine.executor import Executor, InProcessExecutor
from nanoserve.engine.kv_disk import KVDiskTier, file_identity, model_fingerprint
from nanoserve.engine.memory import keep_freed_memory_in_heap
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.rank_build import build_rank
from nanoserve.engine.tp_executor import TensorParallelRanks, TPExecutor
from nanoserve.engine.worker import Worker
from nanoserve.engine.zero_cost_runner import ZeroCostRunner
from nanoserve.model.gguf_split import gguf_model_files
from nanoserve.model.loader import LoadedModel
from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sample.logits_processor import load_processor_classes
from nanoserve.sample.sampler import Sampler


def build_engine_core(config: EngineConfig, *, engine_tokenizer: bool = False) -> EngineCore:
    """The engine core for `config`, its workers started and ready. `engine_tokenizer`: load
    only what the engine reads of the tokenizer (an engine process: the API process makes
    the text; `LLM` keeps the whole one)."""
    keep_freed_memory_in_heap()
    # under tensor parallelism: ranks 1..N-1 started and joined (tp_executor.py)
    ranks = TensorParallelRanks(config) if config.parallel.tensor_parallel_size > 1 else None
    try:
        rank0 = build_rank(config, ranks.group if ranks else None,
                           engine_tokenizer=engine_tokenizer)
        loaded = rank0.loaded
        runner: ModelRunner | ZeroCostRunner = rank0.runner
        max_rows = EngineCore.max_sampled_rows(config)
        if config.model.zero_cost_runner:
            runner = ZeroCostRunner(rank0.runner, max_rows)
        # the sampler lives in rank 0's worker (the core admits with the same checks)
        sampler = Sampler(config.scheduler.max_num_seqs, loaded.arch.vocab_size,
                          config.model.torch_device, loaded.eos_token_ids,
                          ReasoningTokens.of(loaded.tokenizer),
                          load_processor_classes(config.sampler.logits_processors))
        worker = Worker(runner, sampler,
                        None if config.model.zero_cost_runner else rank0.drafter)
        executor: Executor = (InProcessExecutor(worker) if ranks is None
                              else TPExecutor(worker, ranks))
        core = EngineCore(config, executor, loaded.info(), rank0.num_blocks)
        core.kernel_schedule = rank0.kernel_schedule
        if config.cache.kv_cache_disk is not None:
            _attach_disk_tier(core, config, loaded, runner)
    except BaseException:
        if ranks is not None:
            ranks.shutdown()
        raise
    # Everything loaded so far (the model, the tokenizer, the imported libraries: millions of
    # objects) lives as long as the engine: moved out of the collector's sight, the
    # oldest-generation collections that steps trigger no longer walk it (vLLM does the same;
    # the collector took ~2% of the engine thread in `bench throughput`).
    gc.collect()
    gc.freeze()
    return core


logger = logging.getLogger("nanoserve")
# the files of a checkpoint folder that decide a block's bytes (with every *.safetensors)
_CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
DISK_FORMAT = "nanoserve kv disk 1"


def _attach_disk_tier(core: EngineCore, config: EngineConfig, loaded: LoadedModel,
                      runner: ModelRunner | ZeroCostRunner) -> None:
    """The prefix cache's disk tier (`--kv-cache-disk`, engine/kv_disk.py) under the core's
    cache, its files named by this model's fingerprint; off, with a warning, where it cannot
    be exact: tensor parallelism (each rank holds a slice), a hybrid model's DeltaNet states
    (not on disk), no prefix cache."""
    why = ("--no-prefix-caching" if not config.cache.enable_prefix_caching
           else "tensor parallelism" if config.parallel.tensor_parallel_size > 1
           else "a hybrid model's DeltaNet states" if loaded.arch.linear is not None
           else "the zero-cost runner" if not isinstance(runner, ModelRunner) else None)
    if why is not None:
        logger.warning("--kv-cache-disk is off: not with %s", why)
        return
    assert isinstance(runner, ModelRunner) and config.cache.kv_cache_disk is not None
    path = Path(loaded.path)
    files = (gguf_model_files(path) if path.is_file() else  # a split GGUF's every part
             sorted(p for p in path.iterdir() if p.suffix == ".safetensors"
                    or p.name in _CHECKPOINT_FILES))
    fingerprint = model_fingerprint([
        DISK_FORMAT, repr(loaded.arch), loaded.quantization, config.model.dtype,
        str(config.cache.block_size), runner.kv_block_layout(),
        *(p.name.encode() + file_identity(p) for p in files)])
    tier = KVDiskTier(Path(config.cache.kv_cache_disk), config.cache.kv_cache_disk_bytes,
                      fingerprint, str(path.resolve()))
    core.kv_cache.keep_disk_tier(tier, runner.read_kv_block, runner.write_kv_block,
                                 runner.kv_block_nbytes)
    logger.info("KV disk tier: %s (%d files, up to %.1f GiB)", tier.folder,
                tier.num_files, config.cache.kv_cache_disk_bytes / (1 << 30))

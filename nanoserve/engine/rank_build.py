"""What every tensor-parallel rank builds for itself, rank 0 and the others alike: its shard of
the model, its KV cache and the model runner over them (`build_rank`).

Rank 0 sizes the cache (its memory budget, the model's context) and every other rank takes that
count from it over the group, so all ranks' caches hold the same blocks and the step's block
table means the same on each. One function for every rank, so a rank never differs from rank 0
in how it loads, which cache type it picks or whether the native layer stack may run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nanoserve.config import EngineConfig
from nanoserve.engine.memory import check_kv_cache_fits
from nanoserve.engine.model_runner import (
    ModelRunner,
    kv_bytes_per_block,
    kv_cache_num_blocks,
    resolve_kv_cache_dtype,
)
from nanoserve.engine.mtp_drafter import MtpDrafter
from nanoserve.engine.state_pool import num_state_slots as state_slots
from nanoserve.engine.state_pool import ssm_state_dtype
from nanoserve.kernel_tuning.tuner import BUDGET_S, preferred_tier, tune_kernels
from nanoserve.model.loader import LoadedModel, load_model
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.native import prefer_tier
from nanoserve.speculative_config import uses_mtp

logger = logging.getLogger("nanoserve")


@dataclass
class RankBuild:
    """One rank's model and runner, the cache's block count (the same on every rank) and the
    kernels' schedule it runs (kernel_tuning/)."""

    loaded: LoadedModel
    runner: ModelRunner
    num_blocks: int
    kernel_schedule: str = ""  # the schedule in one line ("" on a GPU or without kernels)
    drafter: MtpDrafter | None = None  # the model's MTP head, where the config asks for it


def build_rank(config: EngineConfig, group: TensorParallelGroup | None, *,
               engine_tokenizer: bool) -> RankBuild:
    """Load this rank's shard (the whole model without a group), size or receive the cache's
    block count, and build the runner. `engine_tokenizer`: load only what the engine reads of
    the tokenizer (an engine process, whose text is made by the API process)."""
    model, cache = config.model, config.cache
    device, dtype = model.torch_device, model.torch_dtype
    is_alone = group is None or group.world_size == 1
    if device.type == "cpu":  # the tier measured fastest here, before the first kernel loads
        tier = preferred_tier(model.kernel_tuning)
        if tier is not None:
            prefer_tier(tier)
    use_mtp = uses_mtp(config.scheduler.draft_proposer)
    loaded = load_model(model.model, device, dtype, model.max_model_len, model.quantization,
                        group, engine_tokenizer=engine_tokenizer, mmproj=model.mmproj,
                        keep_mtp=use_mtp)
    if use_mtp:
        check_mtp_head(loaded)
    num_draft_layers = int(use_mtp)
    kv_dtype = resolve_kv_cache_dtype(cache.kv_cache_dtype, loaded.quantization, device, dtype)
    is_rank0 = group is None or group.rank == 0
    num_blocks = 0
    if is_rank0:
        num_blocks = cache.num_blocks or kv_cache_num_blocks(
            cache.kv_cache_memory_bytes, loaded.arch, cache.block_size, kv_dtype, device,
            max_num_seqs=config.scheduler.max_num_seqs,
            context_len=model.max_model_len or loaded.arch.max_position_embeddings,
            num_draft_layers=num_draft_layers)
    if group is not None and group.world_size > 1:  # every rank's cache: rank 0's blocks
        num_blocks = group.broadcast_int(num_blocks)
    if device.type == "cpu":
        check_kv_cache_fits(num_blocks * kv_bytes_per_block(loaded.arch, cache.block_size,
                                                            kv_dtype, num_draft_layers))
    num_state_slots = 0
    if loaded.arch.linear is not None:  # a hybrid: its DeltaNet states beside the KV cache
        if not is_alone:
            raise ValueError("tensor parallelism does not run hybrid (Gated DeltaNet) models "
                             "yet; use --tensor-parallel-size 1")
        num_state_slots = state_slots(loaded.arch, config.scheduler, num_blocks, cache)
    runner = ModelRunner(loaded.model, num_blocks, cache.block_size, device, kv_dtype,
                         use_native_layers=not model.enforce_eager,
                         num_state_slots=num_state_slots, ssm_dtype=ssm_state_dtype(cache))
    drafter = None
    if loaded.mtp_head is not None:
        drafter = MtpDrafter(loaded.model, loaded.mtp_head, runner.plan, num_blocks=num_blocks,
                             block_size=cache.block_size,
                             num_slots=config.scheduler.max_num_seqs,
                             num_drafts=config.scheduler.num_speculative_tokens,
                             cache_dtype=kv_dtype, device=device)
    schedule = ""
    if device.type == "cpu":
        # ranks of one host would time each other's noise: they read the cache, time nothing
        mode = model.kernel_tuning if is_alone or model.kernel_tuning == "off" else "cached"
        schedule = tune_kernels(loaded.model, runner, mode,
                                budget_s=BUDGET_S if is_alone else 0.0).describe()
        logger.info("CPU kernels: %s (--kernel-tuning %s)", schedule, model.kernel_tuning)
    return RankBuild(loaded, runner, num_blocks, schedule, drafter)


def check_mtp_head(loaded: LoadedModel) -> None:
    """`speculative_config.method` "mtp" needs a hybrid model (Qwen3.5, Qwen3-Next) whose
    checkpoint holds its MTP head (`mtp.*`): a ValueError saying which is missing."""
    if loaded.arch.linear is None:
        raise ValueError(f"speculative_config.method 'mtp' runs a Qwen3.5 (Qwen3-Next) model's "
                         f"MTP head; {loaded.name} is a {loaded.arch.family} model: use "
                         "'ngram' or 'suffix'")
    if loaded.mtp_head is None:
        where = ("" if loaded.path.is_dir() else
                 " (a GGUF file's MTP blocks are not read: use the safetensors checkpoint)")
        raise ValueError(f"speculative_config.method 'mtp' needs the checkpoint's MTP head "
                         f"(mtp.* weights); {loaded.path} has none{where}: use 'ngram' or "
                         "'suffix'")

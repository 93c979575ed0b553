"""A hybrid model's step, the core's side: which DeltaNet states each admitted request starts
from and which block boundaries the step snapshots (the bookkeeping is engine/state_cache.py's,
the states the worker's pool's, engine/state_pool.py)."""

from __future__ import annotations

from nanoserve.config import EngineConfig
from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.state_cache import StateSnapshots
from nanoserve.engine.state_pool import num_snapshot_slots
from nanoserve.engine.step_input import step_first_rows
from nanoserve.model.arch import ArchConfig
from nanoserve.protocol import StepInput


def state_snapshots_for(config: EngineConfig, arch: ArchConfig,
                        num_blocks: int) -> StateSnapshots | None:
    """A hybrid model's snapshot bookkeeping, over the pool's slots after the live ones; None
    where there are none (no DeltaNet layers, or no prefix cache)."""
    count = num_snapshot_slots(arch, num_blocks, config.cache.enable_prefix_caching)
    if not count:
        return None
    return StateSnapshots(config.scheduler.max_num_seqs, count, config.cache.block_size,
                          config.cache.mamba_block_size)


def plan_states(sched: SchedulerOutput, step: StepInput, states: StateSnapshots | None,
                kv_cache: KVCacheManager) -> None:
    """Every admitted request's states start from zeros or its prefix hit's snapshot
    (`state_inits`), and the step snapshots the block boundaries the prefix cache keeps
    (`state_snapshots`, by row)."""
    step.state_inits = [(r.slot, r.state_source) for r in sched.admitted if r.slot is not None]
    if states is None:
        return
    for s, first_row in zip(sched.scheduled, step_first_rows(sched.scheduled), strict=True):
        end = s.start + s.num_new_tokens - len(s.draft_token_ids)
        planned = states.plan(kv_cache.block_hashes(s.request), s.start, end,
                              s.request.num_prompt_tokens)
        step.state_snapshots.extend((first_row + token - s.start, slot)
                                    for token, slot in planned)

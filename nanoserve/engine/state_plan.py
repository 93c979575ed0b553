"""A hybrid model's step, the core's side: which DeltaNet states each admitted request starts
from, which block boundaries the step snapshots, and with speculation which states a verify
chunk keeps (the bookkeeping is engine/state_cache.py's and engine/draft_states.py's, the
states the worker's pool's, engine/state_pool.py)."""

from __future__ import annotations

from nanoserve.config import EngineConfig
from nanoserve.engine.draft_states import DraftStates
from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.scheduler import SchedulerOutput
from nanoserve.engine.state_cache import StateSnapshots
from nanoserve.engine.state_pool import num_draft_tokens, num_snapshot_slots
from nanoserve.engine.step_input import step_first_rows
from nanoserve.model.arch import ArchConfig
from nanoserve.protocol import StepInput


def state_snapshots_for(config: EngineConfig, arch: ArchConfig,
                        num_blocks: int) -> StateSnapshots | None:
    """A hybrid model's snapshot bookkeeping, over the pool's slots after the live ones; None
    where there are none (no DeltaNet layers, or no prefix cache)."""
    count = num_snapshot_slots(arch, num_blocks, config.cache)
    if not count:
        return None
    return StateSnapshots(config.scheduler.max_num_seqs, count, config.cache.block_size,
                          config.cache.mamba_block_size)


def draft_states_for(config: EngineConfig, arch: ArchConfig,
                     num_blocks: int) -> DraftStates | None:
    """A hybrid model's draft slots, after the snapshot slots (engine/state_pool.py's
    layout); None without DeltaNet layers or without a proposer."""
    num_drafts = num_draft_tokens(config.scheduler)
    if arch.linear is None or not num_drafts:
        return None
    live = config.scheduler.max_num_seqs
    return DraftStates(live + num_snapshot_slots(arch, num_blocks, config.cache), num_drafts)


def plan_states(sched: SchedulerOutput, step: StepInput, states: StateSnapshots | None,
                kv_cache: KVCacheManager, drafts: DraftStates | None = None) -> None:
    """Every admitted request's states start from zeros or its prefix hit's snapshot
    (`state_inits`, after the copies the last step's acceptance asks for), and the step
    snapshots the block boundaries the prefix cache keeps and each verify chunk's draft rows
    (`state_snapshots`, by row). A verify chunk's boundaries are planned after acceptance
    (`DraftStates.commit`): a row holds one snapshot, and a rejected one must not be kept."""
    pending = drafts.take_pending() if drafts is not None else []
    step.state_inits = pending + [(r.slot, r.state_source) for r in sched.admitted
                                  if r.slot is not None]
    first_rows = step_first_rows(sched.scheduled)
    if drafts is not None:
        drafts.plan(sched.scheduled, first_rows, step.state_snapshots)
    if states is None:
        return
    for s, first_row in zip(sched.scheduled, first_rows, strict=True):
        if s.draft_token_ids:
            continue
        planned = states.plan(kv_cache.block_hashes(s.request), s.start,
                              s.start + s.num_new_tokens, s.request.num_prompt_tokens)
        step.state_snapshots.extend((first_row + token - s.start, slot)
                                    for token, slot in planned)

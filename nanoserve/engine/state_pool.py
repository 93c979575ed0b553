"""A hybrid model's DeltaNet states beside the paged KV cache: the worker's pool of them.

A Gated DeltaNet layer (model/hybrid_layers.py) carries a sequence's whole past in two states
(the conv's last inputs and a recurrent matrix per value head), the same size at any length.
The pool holds them for every slot in two tensors over all DeltaNet layers: the conv states
float32, the recurrent ones float32 or, with --mamba-ssm-cache-dtype (vLLM's flag), bfloat16 or
float16 (`ssm_state_dtype`; rounded after every token, model/delta_net_ops.py), which halves
their bytes and so nearly doubles the snapshots that fit the same memory:

- slots [0, max_num_seqs): the live states, one per running request, at the request's slot
  (the sampler's slot: engine/scheduler.py hands them out);
- slots [max_num_seqs, max_num_seqs + snapshots): snapshots, the states as they stood at a
  block boundary, which the core's prefix cache (engine/state_cache.py) keys by that block's
  hash. A prefix hit copies one into the request's live slot, so the rest of the prompt is
  computed from the exact state the prefix left;
- slots [max_num_seqs + snapshots, ... + max_num_seqs * k), with speculation (k drafts a step):
  each live slot's k draft slots. A verify step (rows: the last token, drafts 1..k) copies
  the state after each row but the last into them, and the next step copies the one after the
  last accepted row back into the live slot (engine/draft_states.py), so a rejected draft
  leaves no trace. Their pages are touched only by slots that draft.

Each step the worker first sets states as the core lists them (`state_inits`, in order: the
last step's accepted drafts and new snapshots, then the requests admitted in this step, zeros
for a fresh start or a snapshot's copy), then the forward updates the live states and
writes the snapshots the step asks for (`state_snapshots`, by row) as it passes them.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.config import CacheConfig, GiB, SchedulerConfig
from nanoserve.model.arch import ArchConfig
from nanoserve.model.hybrid_layers import HybridStates
from nanoserve.protocol import StepInput

# Snapshots take at most this much memory (Qwen3.5-0.8B: 19 MiB a float32 snapshot, so ~53;
# 10 MiB with a 16-bit recurrent state, so ~99), and never more snapshots than KV blocks (a
# snapshot is of use only while its block is cached).
DEFAULT_SNAPSHOT_BYTES = 1 * GiB
# The tokens between two snapshots of a long prompt (vLLM's --mamba-block-size): a prefix is
# found up to the last snapshot before it diverges. A prompt's last full block is kept too.
DEFAULT_MAMBA_BLOCK_SIZE = 256


def ssm_state_dtype(cache: CacheConfig) -> torch.dtype:
    """The recurrent states' element type (--mamba-ssm-cache-dtype; "auto": float32)."""
    return {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[cache.mamba_ssm_cache_dtype]


def state_bytes(arch: ArchConfig, cache: CacheConfig) -> int:
    """The bytes one sequence's states take over all DeltaNet layers: float32 conv states and
    recurrent states of `ssm_state_dtype`'s element size."""
    shape = arch.linear
    assert shape is not None
    conv_floats = shape.conv_dim * (shape.conv_kernel - 1)
    ssm_values = shape.num_value_heads * shape.key_head_dim * shape.value_head_dim
    ssm_size = torch.empty((), dtype=ssm_state_dtype(cache)).element_size()
    return (4 * conv_floats + ssm_size * ssm_values) * len(arch.linear_layers)


def num_snapshot_slots(arch: ArchConfig, num_blocks: int, cache: CacheConfig) -> int:
    """The snapshot slots a hybrid model's pool gets (0 without prefix caching or DeltaNet);
    the core and the worker both compute it, from the same numbers."""
    if arch.linear is None or not cache.enable_prefix_caching:
        return 0
    return min(num_blocks, DEFAULT_SNAPSHOT_BYTES // state_bytes(arch, cache))


def num_draft_tokens(scheduler: SchedulerConfig) -> int:
    """The drafts a request may verify in a step (0 without a proposer)."""
    return scheduler.num_speculative_tokens if scheduler.draft_proposer is not None else 0


def num_state_slots(arch: ArchConfig, scheduler: SchedulerConfig, num_blocks: int,
                    cache: CacheConfig) -> int:
    """The pool's slots (see the module): live, snapshot and draft slots; the core's plans
    (engine/state_plan.py) address the same layout from the same numbers."""
    live = scheduler.max_num_seqs
    return (live * (1 + num_draft_tokens(scheduler))
            + num_snapshot_slots(arch, num_blocks, cache))


class StatePool:
    """Every slot's DeltaNet states (see the module). Left unfilled: a live slot is set when
    its request is admitted, a snapshot slot written before it is found and a draft slot by
    its verify step before it is copied back, so nothing reads a slot first, and the pages of
    slots never used are never touched (0.8B: 19 MiB a slot, 10 MiB with a 16-bit
    `ssm_dtype`)."""

    def __init__(self, arch: ArchConfig, num_slots: int, device: torch.device,
                 ssm_dtype: torch.dtype = torch.float32) -> None:
        shape = arch.linear
        assert shape is not None, "a state pool is for a hybrid model"
        layers = len(arch.linear_layers)
        self.num_slots = num_slots
        self.conv = torch.empty(num_slots, layers, shape.conv_dim, shape.conv_kernel - 1,
                                device=device)
        self.ssm = torch.empty(num_slots, layers, shape.num_value_heads, shape.key_head_dim,
                               shape.value_head_dim, device=device, dtype=ssm_dtype)

    def step_states(self, step: StepInput) -> HybridStates:
        """Set the admitted requests' states, and the step's view of the pool."""
        for dst, src in step.state_inits:
            if src < 0:
                self.conv[dst].zero_()
                self.ssm[dst].zero_()
            else:
                self.conv[dst].copy_(self.conv[src])
                self.ssm[dst].copy_(self.ssm[src])
        snapshots = np.full(step.num_tokens, -1, dtype=np.int32)
        for row, slot in step.state_snapshots:
            snapshots[row] = slot
        return HybridStates(  # (the indexes stay on the CPU, where the kernels read them)
            self.conv, self.ssm, torch.from_numpy(np.asarray(step.seq_slots, dtype=np.int32)),
            torch.from_numpy(step.query_start_loc.astype(np.int32)),
            torch.from_numpy(snapshots))

"""A hybrid model's DeltaNet states beside the paged KV cache: the worker's pool of them.

A Gated DeltaNet layer (model/hybrid_layers.py) carries a sequence's whole past in two states
(the conv's last inputs and a recurrent matrix per value head), the same size at any length.
The pool holds them for every slot, float32, in two tensors over all DeltaNet layers:

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

from nanoserve.config import GiB, SchedulerConfig
from nanoserve.model.arch import ArchConfig
from nanoserve.model.hybrid_layers import HybridStates
from nanoserve.protocol import StepInput

# Snapshots take at most this much memory (Qwen3.5-0.8B: 19 MiB a snapshot, so ~53), and never
# more snapshots than KV blocks (a snapshot is of use only while its block is cached).
DEFAULT_SNAPSHOT_BYTES = 1 * GiB
# The tokens between two snapshots of a long prompt (vLLM's --mamba-block-size): a prefix is
# found up to the last snapshot before it diverges. A prompt's last full block is kept too.
DEFAULT_MAMBA_BLOCK_SIZE = 256


def state_bytes(arch: ArchConfig) -> int:
    """The bytes one sequence's states take over all DeltaNet layers (float32)."""
    assert arch.linear is not None
    return 4 * arch.linear.state_floats * len(arch.linear_layers)


def num_snapshot_slots(arch: ArchConfig, num_blocks: int, prefix_caching: bool) -> int:
    """The snapshot slots a hybrid model's pool gets (0 without prefix caching or DeltaNet);
    the core and the worker both compute it, from the same numbers."""
    if arch.linear is None or not prefix_caching:
        return 0
    return min(num_blocks, DEFAULT_SNAPSHOT_BYTES // state_bytes(arch))


def num_draft_tokens(scheduler: SchedulerConfig) -> int:
    """The drafts a request may verify in a step (0 without a proposer)."""
    return scheduler.num_speculative_tokens if scheduler.draft_proposer is not None else 0


def num_state_slots(arch: ArchConfig, scheduler: SchedulerConfig, num_blocks: int,
                    prefix_caching: bool) -> int:
    """The pool's slots (see the module): live, snapshot and draft slots; the core's plans
    (engine/state_plan.py) address the same layout from the same numbers."""
    live = scheduler.max_num_seqs
    return (live * (1 + num_draft_tokens(scheduler))
            + num_snapshot_slots(arch, num_blocks, prefix_caching))


class StatePool:
    """Every slot's DeltaNet states (see the module). Left unfilled: a live slot is set when
    its request is admitted, a snapshot slot written before it is found and a draft slot by
    its verify step before it is copied back, so nothing reads a slot first, and the pages of
    slots never used are never touched (0.8B: 19 MiB a slot)."""

    def __init__(self, arch: ArchConfig, num_slots: int, device: torch.device) -> None:
        shape = arch.linear
        assert shape is not None, "a state pool is for a hybrid model"
        layers = len(arch.linear_layers)
        self.num_slots = num_slots
        self.conv = torch.empty(num_slots, layers, shape.conv_dim, shape.conv_kernel - 1,
                                device=device)
        self.ssm = torch.empty(num_slots, layers, shape.num_value_heads, shape.key_head_dim,
                               shape.value_head_dim, device=device)

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

"""Every running request's block ids as rows of one array, indexed by the request's slot.

The decode attention kernel reads a [num_decodes, max_blocks] int32 table each step. Building
it from Python lists costs a loop over the batch and a fresh array every step; here each slot's
row is written once when the request is admitted and then only where a block is added (one new
block every `block_size` tokens), so a step's table is one fancy index of this array.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    """[num_slots, max_blocks] int32 block ids and each slot's count of valid entries."""

    def __init__(self, num_slots: int, max_blocks_per_slot: int) -> None:
        self.table = np.zeros((num_slots, max_blocks_per_slot), dtype=np.int32)
        self.num_blocks = np.zeros(num_slots, dtype=np.int64)

    def sync(self, slot: int, block_ids: list[int]) -> None:
        """Copy what is new in `block_ids` (the KV cache's live list for the request in `slot`):
        a request's blocks only grow while it holds its slot."""
        known = int(self.num_blocks[slot])
        if known != len(block_ids):
            self.table[slot, known : len(block_ids)] = block_ids[known:]
            self.num_blocks[slot] = len(block_ids)

    def clear(self, slot: int) -> None:
        """The slot's request finished or was preempted: its next owner starts empty."""
        self.num_blocks[slot] = 0

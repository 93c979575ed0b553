"""The prefix cache's half for a hybrid model's DeltaNet states: which snapshot holds the state
a cached prefix left, and where a step writes new ones (the core's bookkeeping; the states
themselves live in the worker's pool, engine/state_pool.py).

A cached prefix of attention layers is its KV blocks; a DeltaNet layer's is its state after the
prefix's last token, which no block holds. So states are snapshotted at block boundaries, keyed
by the hash of the block that ends there (the same hash chain the KV blocks are found by), and
a prefix is a hit only up to its last boundary with a snapshot: there the request's live state
starts as that snapshot's copy and the rest is computed as a fresh one would be, token for
token, so a hit gives bit for bit what computing it all gives (the kernels' bits do not depend
on chunks or batches: model/delta_net_ops.py).

Where snapshots are taken: every `interval` tokens of a sequence (vLLM's --mamba-block-size;
a new conversation that shares a long system prompt finds the last one before it diverges),
and at a prompt's last two full blocks before its last token (the next turn of a
conversation, which sends this prompt again with more after it, finds all of it; the block
before the last catches a chat template that writes the previous generation prompt's last
few tokens otherwise, as Qwen3's and Qwen3.5's do with `<think>` sections). Snapshots are bounded by
the pool's slots: the least recently used goes first, and one goes with its block when the KV
cache evicts that block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes  # (the KV cache's key: engine/kv_cache.py)
NO_SOURCE = -1  # a fresh state: zeros
PROMPT_TAIL = 2  # a prompt's last full blocks that get a snapshot each


class StateSnapshots:
    """Snapshot slots [first_slot, first_slot + count), keyed by block hash, LRU."""

    def __init__(self, first_slot: int, count: int, block_size: int, interval: int) -> None:
        self.block_size = block_size
        # snapshot every `interval` tokens, a whole number of blocks
        self.interval_blocks = max(1, -(-interval // block_size))
        self.free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[BlockHash, int] = OrderedDict()

    def longest_hit(self, hashes: Sequence[BlockHash], num_blocks: int) -> tuple[int, int]:
        """Of a prefix of `num_blocks` cached blocks (`hashes`: its chain), the longest run
        that ends where a snapshot is, and that snapshot's slot: (blocks, slot); (0,
        NO_SOURCE) if none. The snapshot found counts as used."""
        for n in range(num_blocks, 0, -1):
            slot = self.by_hash.get(hashes[n - 1])
            if slot is not None:
                self.by_hash.move_to_end(hashes[n - 1])
                return n, slot
        return 0, NO_SOURCE

    def forget(self, block_hash: BlockHash) -> None:
        """The KV cache evicted this block: its snapshot is of no more use."""
        slot = self.by_hash.pop(block_hash, None)
        if slot is not None:
            self.free.append(slot)

    def plan(self, hashes: Sequence[BlockHash], start: int, end: int,
             num_prompt_tokens: int) -> list[tuple[int, int]]:
        """The snapshots a step computing tokens [start, end) of a sequence writes: (the token
        after which, slot), each slot now the one its block's hash finds (`hashes`: the
        sequence's full blocks' chain, as far as its tokens are known)."""
        size = self.block_size
        prompt_end = (num_prompt_tokens - 1) // size  # blocks before the prompt's last token
        taken = []
        tail = range(prompt_end - PROMPT_TAIL + 1, prompt_end + 1)
        for blocks in range(start // size + 1, end // size + 1):
            if blocks % self.interval_blocks and blocks not in tail:
                continue
            if blocks > len(hashes) or hashes[blocks - 1] in self.by_hash:
                continue
            slot = self._take()
            if slot is None:
                break
            self.by_hash[hashes[blocks - 1]] = slot
            taken.append((blocks * size - 1, slot))
        return taken

    def _take(self) -> int | None:
        """A free slot, or the least recently used snapshot's."""
        if self.free:
            return self.free.pop()
        if not self.by_hash:
            return None
        _, slot = self.by_hash.popitem(last=False)
        return slot

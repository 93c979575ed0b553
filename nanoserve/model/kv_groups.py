"""Layers grouped for the KV cache, so that a sliding window's blocks can be given back.

A model whose layers all attend the same keys (every layer global, or every layer in one
window, as Mistral) is one group: a block holds every layer's keys and values for its tokens,
and a request has one block table. Where windowed and global layers mix (Gemma 3: five of six
layers in a 512-token window), the layers are cut into groups of `group_size` layers of one
kind, and each group has block tables of its own over one shared pool of blocks, each block
holding `group_size` layers' rows (vLLM's hybrid allocator, in its simplest form). A windowed
group gives back a request's blocks once they fall out of its window, so a long context holds
blocks for its global groups only, plus a window's worth per windowed group.

Layer `l` reads and writes cache tensors `slot_of_layer[l]` (one of `group_size` pairs, shared
by the groups: a block belongs to one group at a time) through group `group_of_layer[l]`'s
block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanoserve.model.arch import ArchConfig

UNBOUNDED_TOKENS = 1 << 40  # a context of windowed layers only: its blocks are given back


@dataclass(frozen=True)
class KVGroups:
    """Which layers share a block table, and each group's window (0: the whole context)."""

    windows: tuple[int, ...]  # per group
    layers: tuple[tuple[int, ...], ...]  # per group, its layers in order
    group_size: int  # layers a block holds (every group has this many)
    # the model's layers, where some have no KV (a hybrid's DeltaNet layers: they are given
    # group 0 and slot 0, and never read them); 0: every layer is in a group
    num_layers: int = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def tokens_held(self, num_blocks: int, block_size: int) -> int:
        """The longest context one request can hold in `num_blocks` blocks: a window's
        worth (and a block) per windowed group, the rest across the global groups."""
        num_global = sum(1 for w in self.windows if not w)
        window_blocks = sum(-(-w // block_size) + 1 for w in self.windows if w)
        if num_global == 0:  # every group windowed: any length, once the windows fit
            return UNBOUNDED_TOKENS if num_blocks >= window_blocks else 0
        return max(0, num_blocks - window_blocks) // num_global * block_size

    @property
    def group_of_layer(self) -> list[int]:
        found = {layer: g for g, members in enumerate(self.layers) for layer in members}
        return [found.get(layer, 0) for layer in range(self.num_layers or len(found))]

    @property
    def slot_of_layer(self) -> list[int]:
        found = {layer: j for members in self.layers for j, layer in enumerate(members)}
        return [found.get(layer, 0) for layer in range(self.num_layers or len(found))]


def kv_layer_groups(arch: ArchConfig) -> KVGroups:
    """One group for a model whose layers attend alike; else groups of the largest size that
    divides both kinds' layer counts, global groups last."""
    if arch.linear is not None:  # a hybrid: its attention layers (all global) hold KV
        layers = arch.attention_layers
        return KVGroups((0,), (layers,), len(layers), arch.num_layers)
    windows = [arch.layer_window(i) for i in range(arch.num_layers)]
    kinds = sorted(set(windows), reverse=True)  # windowed first
    if len(kinds) == 1:
        return KVGroups((kinds[0],), (tuple(range(arch.num_layers)),), arch.num_layers)
    by_kind = {w: [i for i, v in enumerate(windows) if v == w] for w in kinds}
    size = math.gcd(*(len(members) for members in by_kind.values()))
    groups = [(w, tuple(members[i : i + size])) for w, members in by_kind.items()
              for i in range(0, len(members), size)]
    return KVGroups(tuple(w for w, _ in groups), tuple(m for _, m in groups), size)

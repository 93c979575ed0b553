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

Gemma 4 adds two things. Its windowed and global layers have rows of different shapes (KV heads
x head size): each shape has its own `group_size` tensor pairs over the same block ids, so a
block costs every shape's rows (`KVGroups.shapes`; the runner counts a block's bytes so). And its
KV-shared layers own no cache: they read their source layer's tensors through its group
(`sources`), so they take no slot and no block.
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
    # per group, its rows' (KV heads, head size); () where every layer has the arch's
    shapes: tuple[tuple[int, int], ...] = ()
    # per layer, the layer whose cache it reads (itself, or a KV-shared layer's source);
    # () where each layer reads its own
    sources: tuple[int, ...] = ()

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
        return [found.get(self._source(layer), 0)
                for layer in range(self.num_layers or len(found))]

    @property
    def slot_of_layer(self) -> list[int]:
        found = {layer: j for members in self.layers for j, layer in enumerate(members)}
        return [found.get(self._source(layer), 0)
                for layer in range(self.num_layers or len(found))]

    def shape_of_layer(self, default: tuple[int, int]) -> list[tuple[int, int]]:
        """Each layer's cache rows' (KV heads, head size); `default` where groups have one."""
        groups = self.group_of_layer
        return [self.shapes[g] if self.shapes else default for g in groups]

    def distinct_shapes(self, default: tuple[int, int]) -> list[tuple[int, int]]:
        """The shapes a block holds rows of, in group order, each once."""
        return list(dict.fromkeys(self.shapes or (default,)))

    def _source(self, layer: int) -> int:
        return self.sources[layer] if self.sources else layer


def kv_layer_groups(arch: ArchConfig) -> KVGroups:
    """One group for a model whose layers attend alike; else groups of the largest size that
    divides both kinds' layer counts, global groups last."""
    if arch.linear is not None:  # a hybrid: its attention layers (all global) hold KV
        layers = arch.attention_layers
        return KVGroups((0,), (layers,), len(layers), arch.num_layers)
    if arch.gemma4 is not None:  # only the layers that own a cache, each with its shape
        owners = arch.gemma4.kv_layers
        groups = _grouped(owners, [arch.layer_window(i) for i in owners])
        return KVGroups(
            groups.windows, groups.layers, groups.group_size, arch.num_layers,
            tuple((arch.layer_kv_heads(m[0]), arch.layer_head_dim(m[0])) for m in groups.layers),
            arch.gemma4.kv_sources)
    return _grouped(tuple(range(arch.num_layers)),
                    [arch.layer_window(i) for i in range(arch.num_layers)])


def _grouped(layers: tuple[int, ...], windows: list[int]) -> KVGroups:
    """`layers` (with their `windows`) in groups of one kind (see kv_layer_groups)."""
    kinds = sorted(set(windows), reverse=True)  # windowed first
    if len(kinds) == 1:
        return KVGroups((kinds[0],), (layers,), len(layers))
    by_kind = {w: [layer for layer, v in zip(layers, windows, strict=True) if v == w]
               for w in kinds}
    size = math.gcd(*(len(members) for members in by_kind.values()))
    groups = [(w, tuple(members[i : i + size])) for w, members in by_kind.items()
              for i in range(0, len(members), size)]
    return KVGroups(tuple(w for w, _ in groups), tuple(m for _, m in groups), size)

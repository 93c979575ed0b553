"""The tensor-parallel group a model's layers reduce their partial results over.

Under tensor parallelism (issue 17) each rank holds a slice of every projection: the attention
output projection and the MLP down projection then each give a partial sum that every rank
must add up (one all-reduce after each, Megatron's layout). The decoder layer calls
`all_reduce` at exactly those two places already; at one rank, the only case today, the group
is the identity and returns its argument (a Python call, ~50 ns: no copy, no op).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """This process's rank among `world_size` ranks that split the model's weights."""

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` [..] over the group's ranks; `x` itself, unchanged, at one rank."""
        if self.world_size == 1:
            return x
        raise NotImplementedError("tensor parallelism (issue 17) brings the multi-rank group")

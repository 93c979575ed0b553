"""Which CPU cores each process or rank runs on: a leaf that imports nothing of the engine (the
launcher imports it before torch; the tensor-parallel executor, node and workers use it too)."""

from __future__ import annotations

import os


def split_cores(cores: list[int], world_size: int) -> list[list[int]] | None:
    """Each rank's cores: the usable ones split evenly (one left for the API server when
    there are more than 2, as vLLM reserves one); None when there are fewer than ranks."""
    usable = sorted(cores)[:-1] if len(cores) > 2 else sorted(cores)
    if len(usable) < world_size:
        return None
    share = len(usable) // world_size
    return [usable[r * share : (r + 1) * share] for r in range(world_size)]


def pin_to_cores(cores: list[int] | None) -> None:
    """Run on `cores` with one torch thread each; without cores of its own, one thread."""
    import torch  # here, not at the top: the launcher imports this module before torch

    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores) if cores else 1)

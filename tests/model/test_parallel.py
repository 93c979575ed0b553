"""The tensor-parallel group (parallel.py) and the two places the decoder layer calls it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_engine, run_to_completion

from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.sampling_params import SamplingParams


def test_one_rank_is_the_identity() -> None:
    group = TensorParallelGroup()
    x = torch.randn(3, 8)
    assert group.is_single and group.all_reduce(x) is x


def test_a_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside a group of 2"):
        TensorParallelGroup(rank=2, world_size=2)


class RecordingGroup:
    """One rank that records the shape of what each all-reduce was given."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        return x


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_each_layer_reduces_after_o_and_after_down(quantization: str,
                                                   tiny_model_dir: Any) -> None:
    """Both op tables call the group twice a layer, on [T, hidden] partial sums."""
    path: Path = tiny_model_dir("qwen3")
    engine = make_engine(path, quantization=quantization)
    model = engine.runner.model
    group = RecordingGroup()
    model.group = group
    run_to_completion(engine, {"a": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=2))
    hidden = model.arch.hidden_size
    # two steps: the 3-token prompt, then one decode
    assert group.shapes == ([(3, hidden)] * 2 * model.arch.num_layers
                            + [(1, hidden)] * 2 * model.arch.num_layers)


def _sum_and_gather(rank: int, world: int, port: int, results: Any) -> None:
    """One rank of a gloo group: rank r contributes r + 1 everywhere, and a [2, 3] slice."""
    from nanoserve.model.parallel import destroy_group, init_group

    torch.set_num_threads(1)
    group = init_group(rank, world, "127.0.0.1", port)
    summed = group.all_reduce(torch.full((4,), float(rank + 1)))
    part = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * rank
    gathered = group.gather_to_rank0(part)
    blocks = group.broadcast_int(1234 if rank == 0 else -1)
    results.put((rank, summed.tolist(), gathered.tolist(), blocks))
    destroy_group(group)


@pytest.mark.distributed
def test_gloo_group_sums_and_gathers_to_rank0() -> None:
    """Two processes on loopback: the in-place sum everywhere, the vocabulary slices joined
    on rank 0 only, rank 0's block count on both."""
    import multiprocessing

    from nanoserve.model.parallel import destroy_group, init_group, open_rendezvous

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store, port = open_rendezvous()
    child = context.Process(target=_sum_and_gather, args=(1, 2, port, results))
    child.start()
    group = init_group(0, 2, "127.0.0.1", port, store=store)
    try:
        summed = group.all_reduce(torch.full((4,), 1.0))
        gathered = group.gather_to_rank0(torch.arange(6, dtype=torch.float32).view(2, 3))
        blocks = group.broadcast_int(1234)
        _, other_sum, other_gathered, other_blocks = results.get(timeout=30)
    finally:
        destroy_group(group)
        child.join(timeout=30)
    assert summed.tolist() == other_sum == [3.0] * 4
    assert gathered.tolist() == [[0, 1, 2, 10, 11, 12], [3, 4, 5, 13, 14, 15]]
    assert other_gathered == [[10, 11, 12], [13, 14, 15]]  # rank 1 keeps its own slice
    assert blocks == other_blocks == 1234
    assert child.exitcode == 0

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
    model = engine.loaded.model
    group = RecordingGroup()
    model.group = group
    run_to_completion(engine, {"a": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=2))
    hidden = model.arch.hidden_size
    # two steps: the 3-token prompt, then one decode
    assert group.shapes == ([(3, hidden)] * 2 * model.arch.num_layers
                            + [(1, hidden)] * 2 * model.arch.num_layers)

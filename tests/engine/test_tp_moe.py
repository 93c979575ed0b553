"""A MoE model under tensor parallelism, end to end: two ranks (each holding every expert's
half of the intermediate rows, the shared expert's half and the whole router) give one rank's
greedy tokens and logprobs, preemptions included."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from test_tp_executor import assert_close_logprobs, run, tp_engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from moe_checkpoints import write_tiny_moe

from nanoserve.engine.tp_executor import TPExecutor
from nanoserve.sampling_params import SamplingParams

pytestmark = pytest.mark.distributed


def test_two_ranks_of_a_moe_model_equal_one(tmp_path: Path, default_tokenizer: Any) -> None:
    path = write_tiny_moe("qwen2_moe", tmp_path / "moe", default_tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = {f"r{i}": ([5 + i, *range(300 + 40 * i, 330 + 41 * i)], params)
               for i in range(4)}
    one = run(tp_engine(path, 1, num_blocks=8), prompts)
    engine = tp_engine(path, 2, num_blocks=8)
    try:
        assert isinstance(engine.executor, TPExecutor)
        assert engine.runner.model.arch.moe.moe_intermediate_size == 16  # this rank's half
        two = run(engine, prompts)
        assert engine.stats.num_preemptions > 0, "8 blocks should preempt four requests"
    finally:
        engine.shutdown()
    for request_id in prompts:
        assert two[request_id]["tokens"] == one[request_id]["tokens"], request_id
        assert_close_logprobs(two[request_id]["logprobs"], one[request_id]["logprobs"])

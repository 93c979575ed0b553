"""`bench step`'s floor for a MoE model (bench/floor.py): a MoE layer's experts count as many
as the step's tokens choose, never all of them at one token."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from helpers import make_engine
from moe_checkpoints import write_tiny_moe

from nanoserve.bench.floor import MachineRates, step_floor
from nanoserve.model.quant_linear import QuantizedWeight


def _bytes(weight: Any) -> int:
    assert isinstance(weight, QuantizedWeight) and weight.is_packed
    return weight.data.numel()


def _macs(weight: Any) -> int:
    return weight.shape[0] * weight.shape[1]


def test_the_floor_reads_the_chosen_experts_and_does_their_products(
        tmp_path: Path, default_tokenizer: Any) -> None:
    path = write_tiny_moe("qwen2_moe", tmp_path / "moe", default_tokenizer)
    engine = make_engine(path, quantization="int8")
    model = engine.runner.model
    key_cache = engine.runner.kv_caches[0][0]
    rates = MachineRates(read_bytes_per_s=1e9, macs_per_s=1e9)
    whole = [model.lm_head] + [w for layer in model.decoder_layers
                               for w in (layer.qkv_proj, layer.o_proj)]
    blocks = [layer.moe for layer in model.decoder_layers]
    assert all(block is not None for block in blocks)  # every layer is MoE
    expert = [blocks[0].experts[0].gate_up_proj, blocks[0].experts[0].down_proj]
    shared = [blocks[0].shared_expert.gate_up_proj, blocks[0].shared_expert.down_proj]
    router = blocks[0].gate
    top_k, num_experts, num_layers = 2, 4, len(blocks)

    def expected(batch: int, experts_read: float) -> tuple[float, float]:
        num_bytes = (sum(map(_bytes, whole)) + num_layers * (
            experts_read * sum(map(_bytes, expert)) + sum(map(_bytes, shared))
            + router.numel() * 4))
        macs = batch * (sum(map(_macs, whole)) + num_layers * (
            top_k * sum(map(_macs, expert)) + sum(map(_macs, shared)) + router.numel()))
        return num_bytes, macs

    one = step_floor(model, key_cache, batch=1, context_len=0, rates=rates)
    assert (one.bytes_read, one.macs) == pytest.approx(expected(1, top_k))  # k of 4 experts
    # three tokens hit 4 (1 - (1/2)^3) = 3.5 experts on average, with the products of 6
    three = step_floor(model, key_cache, batch=3, context_len=0, rates=rates)
    assert (three.bytes_read, three.macs) == pytest.approx(expected(3, 3.5))
    assert num_experts * (1 - (1 - top_k / num_experts) ** 3) == 3.5

"""weight_arena.py: the packed weights gathered into one huge-page buffer, in the order a step
reads them, with their bytes (and so every output) unchanged."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import make_engine, run_to_completion
from test_fused_model import GREEDY, prompts

from nanoserve.model import weights as weight_loading
from nanoserve.model.quant_linear import QuantizedWeight, kernels
from nanoserve.model.weight_arena import HUGE_PAGE_BYTES, gather_packed_weights, hugepage_buffer

needs_kernel = pytest.mark.skipif(kernels() is None, reason="the quant_matmul kernel is missing")


def test_the_buffer_starts_on_a_huge_page_and_is_zero() -> None:
    buffer = hugepage_buffer(3 * HUGE_PAGE_BYTES + 5)
    assert buffer.numel() == 3 * HUGE_PAGE_BYTES + 5 and buffer.dtype == torch.uint8
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not buffer.any()
    buffer[-1] = 7  # writable to its last byte
    assert int(buffer[-1]) == 7


def _read_order(model: Any) -> list[QuantizedWeight]:
    weights = [getattr(layer, name) for layer in model.decoder_layers
               for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    return [*weights, model.lm_head]


@needs_kernel
def test_loaded_weights_lie_in_one_buffer_in_read_order_with_the_same_bytes(
        tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_model_dir("qwen3")
    engine = make_engine(path, quantization="int8")
    weights = _read_order(engine.runner.model)
    assert all(w.is_packed for w in weights)
    starts = [w.data.data_ptr() for w in weights]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    span = starts[-1] + weights[-1].data.numel() - starts[0]
    assert span <= sum(w.data.numel() + 64 for w in weights), "one buffer, weight after weight"

    # the same checkpoint loaded with the weights left where the loader made them
    monkeypatch.setattr(weight_loading, "gather_packed_weights", lambda model: 0)
    scattered = make_engine(path, quantization="int8")
    originals = _read_order(scattered.runner.model)
    assert all(torch.equal(a.data, b.data) for a, b in zip(originals, weights, strict=True))
    assert run_to_completion(engine, prompts(2), GREEDY) == \
        run_to_completion(scattered, prompts(2), GREEDY)


def test_a_model_without_packed_weights_is_left_as_it_is(tiny_model_dir: Any) -> None:
    engine = make_engine(tiny_model_dir("llama"))  # exact float weights
    model = engine.runner.model
    head = model.lm_head
    assert gather_packed_weights(model) == 0
    assert model.lm_head is head

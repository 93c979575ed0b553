"""`bench step`'s floor (bench/floor.py): the bytes a decode step must read and the
multiply-adds it must do, counted from the model the engine holds."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import make_engine

from nanoserve.bench.floor import MachineRates, format_floors, measure_rates, step_floor
from nanoserve.model.quant_linear import QuantizedWeight


def test_the_floor_counts_the_packed_weights_the_cache_rows_and_the_products(
        tiny_model_dir: Any) -> None:
    engine = make_engine(tiny_model_dir("qwen2"), quantization="int8")
    model = engine.runner.model
    key_cache = engine.executor.worker.runner.kv_caches[0][0]
    weights = [w for layer in model.decoder_layers
               for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    weights.append(model.lm_head)
    assert all(isinstance(w, QuantizedWeight) and w.is_packed for w in weights)
    packed_bytes = sum(w.data.numel() for w in weights)  # uint8 blocks
    arch = model.arch
    row_bytes = key_cache.shape[-1] * key_cache.element_size()
    per_token = arch.num_layers * 2 * arch.num_kv_heads * row_bytes  # keys and values
    products = sum(w.shape[0] * w.shape[1] for w in weights)

    rates = MachineRates(read_bytes_per_s=1e9, macs_per_s=1e9)
    floor = step_floor(model, key_cache, batch=3, context_len=40, rates=rates)
    assert floor.bytes_read == packed_bytes + 3 * 40 * per_token
    assert floor.macs == 3 * products
    assert floor.seconds == max(floor.bytes_read, floor.macs) / 1e9

    slow_arithmetic = MachineRates(read_bytes_per_s=1e12, macs_per_s=1e6)
    assert step_floor(model, key_cache, 3, 40, slow_arithmetic).seconds == 3 * products / 1e6
    table = format_floors([(3, 2 * floor.seconds, floor)], rates)
    assert table.splitlines()[-1].endswith("| 2.00x |  |")  # no kernel read rate measured
    with_kernel = MachineRates(read_bytes_per_s=1e9, macs_per_s=1e9,
                               kernel_read_bytes_per_s=0.5e9)
    kernel_floor = step_floor(model, key_cache, 3, 40, with_kernel)
    assert kernel_floor.kernel_memory_seconds == 2 * kernel_floor.memory_seconds
    row = format_floors([(3, 2 * floor.seconds, kernel_floor)], with_kernel).splitlines()[-1]
    versus_kernel = 2 * floor.seconds / max(kernel_floor.kernel_memory_seconds,
                                            kernel_floor.compute_seconds)
    assert row.endswith(f"| 2.00x | {versus_kernel:.2f}x |")


def test_the_read_rate_is_measured_on_a_buffer_the_size_of_the_steps_weights(
        tiny_model_dir: Any) -> None:
    """A server CPU's L3 can hold the default model's weights between steps: the floor reads
    at the rate a buffer of the step's own bytes, read again and again, gets there (a tiny
    model's at least 64 MB, so that it measures a stream and not L2)."""
    engine = make_engine(tiny_model_dir("qwen2"), quantization="int8")
    model = engine.runner.model
    rates = measure_rates(model, repeats=2)
    weights = [w for layer in model.decoder_layers
               for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    step_bytes = sum(w.data.numel() for w in [*weights, model.lm_head])
    assert rates.read_buffer_bytes == max(64 << 20, step_bytes)
    assert rates.read_bytes_per_s > 0 and rates.macs_per_s > 0
    assert rates.kernel_read_bytes_per_s > 0  # the matmul's own pass over the packed weights
    assert "a sum over 67 MB, the step's weights" in format_floors([], rates)
    assert "the matmul kernel's own one-row read" in format_floors([], rates)

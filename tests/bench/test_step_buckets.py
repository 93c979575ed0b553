"""`bench step`'s buckets: where a decode step's time is put when a few tokens run the decoder
layers as one native region (csrc/team_forward.h), and when more run the dispatcher path."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import make_engine

from nanoserve.bench.roofline import start_decoding
from nanoserve.bench.step import BUCKETS, profile_decode_step, without_usdt_lines
from nanoserve.model.native_layers import native_module


@pytest.mark.skipif(native_module() is None, reason="the decode_layers extension is unavailable")
def test_one_region_steps_go_to_their_own_bucket_and_the_dispatcher_path_to_its_kernels(
        tiny_model_dir: Any) -> None:
    engine = make_engine(tiny_model_dir("qwen2"), quantization="int8", max_num_seqs=32)
    one = profile_decode_step(engine, batch=1, context_len=24, repeats=2)
    many = profile_decode_step(engine, batch=20, context_len=24, repeats=2)
    for measured in (one, many):
        assert set(measured.buckets) == set(BUCKETS)
        assert sum(measured.buckets.values()) == pytest.approx(measured.step_seconds)
    assert one.buckets["one region"] > 0

    # what the buckets are made of: at one token the layers' kernels run inside the region,
    # unseen; at twenty they are the dispatcher's operators, inside the layers' scope
    def kernels_seen(batch: int) -> set[str]:
        ids = start_decoding(engine, batch, 24, 4, f"seen{batch}")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        for request_id in ids:
            engine.abort(request_id)
        names = {event.name for event in prof.events()}
        assert "nanoserve.layers" in names
        return {name for name in names if name.startswith("nanoserve::")}

    assert "nanoserve::decode_attention" not in kernels_seen(1)
    assert {"nanoserve::decode_attention", "nanoserve::packed_matmul"} <= kernels_seen(20)


def test_the_profilers_usdt_lines_stay_off_stderr(tiny_model_dir: Any,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """torch's CPU build writes `USDT:... profiler_start` and `profiler_stop` from C++ each
    time a profiler runs; `bench step` keeps them off its output and passes the rest on."""
    engine = make_engine(tiny_model_dir("qwen2"), quantization="int8", max_num_seqs=4)
    with without_usdt_lines():
        with profile(activities=[ProfilerActivity.CPU]):
            engine.step()
        os.write(2, b"a line of our own\n")
    err = capfd.readouterr().err
    assert "a line of our own" in err and "USDT" not in err
    with profile(activities=[ProfilerActivity.CPU]):  # the pinned torch does write them
        engine.step()
    assert "USDT" in capfd.readouterr().err

"""The DeltaNet strips in the tuner (kernel_tuning/swept_knobs.py): a hybrid model's start
times the strip widths on its own DeltaNet shape and state dtype, keeps the choice, sets it in
the modules that run the mixer (the delta_rule op and the native hybrid stack) and reads it
back at the next start; a cached width this version does not run is timed again. (That every
width gives the same bits: tests/model/test_delta_net_state_dtypes.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_qwen35 import qwen35_dir
from test_ssm_cache_dtype import engine

from nanoserve import native
from nanoserve.kernel_tuning.schedule import DEFAULT, DELTA_NET_STRIP_COLUMNS
from nanoserve.kernel_tuning.tuner import tune_kernels

__all__ = ["qwen35_dir"]  # the fixture used here


@pytest.fixture(autouse=True)
def default_schedule_after() -> Any:
    yield
    native.set_kernel_schedule(DEFAULT.flat())


@pytest.mark.parametrize("ssm_dtype", ["auto", "bfloat16"])
def test_a_hybrid_times_its_strips_and_keeps_them(qwen35_dir: Any, tmp_path: Path,
                                                  ssm_dtype: str) -> None:
    if native.missing_build_tool() is not None:
        pytest.skip(f"the kernels cannot build here: {native.missing_build_tool()}")
    runner = engine(qwen35_dir("dense"), ssm_dtype).runner  # (int8 weights, built untuned)

    def tune() -> Any:
        return tune_kernels(runner.model, runner, "cached", cache_dir=tmp_path,
                            log=lambda _: None)

    first = tune()
    dtype = "float32" if ssm_dtype == "auto" else ssm_dtype
    strips = [row for row in first.rows if row.shape.startswith(f"delta net strips {dtype} ")]
    assert sorted(row.candidate for row in strips) == sorted(
        f"{c} columns" for c in DELTA_NET_STRIP_COLUMNS)
    assert sum(row.is_chosen for row in strips) == 1
    (kept,) = list(tmp_path.glob("*.json"))
    body = json.loads(kept.read_text())
    name = strips[0].shape
    assert body["entries"][name]["columns"] in DELTA_NET_STRIP_COLUMNS
    for module in ("delta_net", "hybrid_layers"):
        assert native.load_kernels(module).get_schedule() == first.schedule.flat(), module
    # the next start times nothing; a width this version does not run is timed again
    assert tune().rows == []
    body["entries"][name] = {"columns": 24}
    kept.write_text(json.dumps(body))
    assert {row.shape for row in tune().rows} == {name}
    assert json.loads(kept.read_text())["entries"][name]["columns"] in DELTA_NET_STRIP_COLUMNS

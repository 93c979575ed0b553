"""The tuner on a real model's weights (kernel_tuning/tuner.py): each shape class timed once,
its choice applied to every kernel module and kept, read back at the next start with nothing
timed; `off` is today's constants; a run past its budget keeps the defaults and keeps nothing;
a cached entry this version cannot read is timed again; `nanoserve tune` prints the table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nanoserve import native
from nanoserve.kernel_tuning.schedule import DEFAULT
from nanoserve.kernel_tuning.tuner import preferred_tier, tune_kernels


@pytest.fixture(autouse=True)
def default_schedule_after() -> Any:
    yield
    native.set_kernel_schedule(DEFAULT.flat())


def tune(int8_tiny_llama: Any, mode: str, cache: Path, **kwargs: Any) -> Any:
    runner = int8_tiny_llama.runner
    return tune_kernels(runner.model, runner, mode, cache_dir=cache, log=lambda _: None,
                        **kwargs)


def schedules() -> list[list[int]]:
    return [m.get_schedule() for m in (native.load_kernels("quant_matmul"),
                                       native.load_kernels("decode_layers"),
                                       native.load_kernels("paged_attention"))]


def test_classes_are_timed_once_applied_and_kept(int8_tiny_llama: Any, tmp_path: Path) -> None:
    first = tune(int8_tiny_llama, "cached", tmp_path)
    names = {row.shape.split(" at ")[0] for row in first.rows}
    assert any("weights S8H 1 row" in n for n in names)  # int8 weights: Q8_0's layout
    assert any(n.startswith("attention float") for n in names)
    assert not first.reused and not first.skipped
    assert schedules() == [first.schedule.flat()] * 3
    (kept,) = list(tmp_path.glob("*.json"))
    entries = json.loads(kept.read_text())["entries"]
    assert set(entries) >= {n for n in names if " weights " in n}
    # the next start reads them all and times nothing
    native.set_kernel_schedule(DEFAULT.flat())
    second = tune(int8_tiny_llama, "cached", tmp_path)
    assert second.rows == [] and sorted(second.reused) == sorted(entries)
    assert second.schedule == first.schedule and schedules() == [first.schedule.flat()] * 3
    if "tier" in entries:
        assert preferred_tier("cached", tmp_path) == entries["tier"]["tier"]
    assert preferred_tier("off", tmp_path) is None
    # force times every class again
    assert tune(int8_tiny_llama, "force", tmp_path).rows


def test_off_is_todays_constants_and_touches_no_file(int8_tiny_llama: Any, tmp_path: Path) -> None:
    result = tune(int8_tiny_llama, "off", tmp_path)
    assert result.schedule == DEFAULT and result.rows == []
    assert schedules() == [DEFAULT.flat()] * 3 and not list(tmp_path.iterdir())


def test_a_run_past_its_budget_keeps_the_defaults_and_nothing_else(int8_tiny_llama: Any,
                                                                   tmp_path: Path) -> None:
    result = tune(int8_tiny_llama, "force", tmp_path, budget_s=0.0)
    assert result.skipped and result.rows == [] and result.schedule == DEFAULT
    assert not list(tmp_path.glob("*.json"))


def test_a_cached_entry_that_cannot_be_read_is_timed_again(int8_tiny_llama: Any,
                                                           tmp_path: Path) -> None:
    tune(int8_tiny_llama, "cached", tmp_path)
    (kept,) = list(tmp_path.glob("*.json"))
    body = json.loads(kept.read_text())
    name = next(n for n in body["entries"] if " weights " in n)
    body["entries"][name] = {"hint": "t9", "bytes": 1024}
    kept.write_text(json.dumps(body))
    again = tune(int8_tiny_llama, "cached", tmp_path)
    assert {row.shape for row in again.rows} == {name}
    assert json.loads(kept.read_text())["entries"][name]["hint"] != "t9"


def test_the_tune_command_prints_the_table(tiny_model_dir: Any, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nanoserve.entrypoints.cli", "tune",
         str(tiny_model_dir("llama")), "--quantization", "int8", "--device", "cpu"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| shape class | candidate | time | rate |" in done.stdout
    assert "chosen" in done.stdout
    # (an AMX CPU's schedule opens with its tiles' threshold, then the prefetch)
    (schedule,) = [line for line in done.stdout.splitlines() if line.startswith("schedule: ")]
    assert "Q8_0 prefetch" in schedule
    assert "kernel tuning for this CPU (1/" in done.stderr

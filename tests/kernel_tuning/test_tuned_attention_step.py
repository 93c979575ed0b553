"""The walk step of decode attention (`attention_block_tokens`) as the tuner handles it: its own
shape class, timed on the model's attention and the fastest step chosen (the default unless
another is clearly faster); its cache entry read back at the next start, and timed alone where
a cache from before it lacks it; the step check keeping or reverting it as a group; a schedule
listed before the knob existed read with its default.

Where a choice must be known in advance, the real attention sweeps are slowed by a sleep that
depends on the step the paged_attention module reports running (as test_step_check.py slows
its steps), so the timing and choosing run for real and only the costs are set by the test."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import pytest

from nanoserve import native
from nanoserve.kernel_tuning.result import TuneResult
from nanoserve.kernel_tuning.schedule import (
    ATTENTION_BLOCK_TOKENS,
    DEFAULT,
    LAYOUTS,
    ROW_CLASSES,
    Schedule,
)
from nanoserve.kernel_tuning.step_check import changed_groups, group_value
from nanoserve.kernel_tuning.tuner import _Run, tune_kernels
from nanoserve.kernel_tuning.workloads import AttentionWork, StepWeights, attention_work

# what every slowed sweep lasts, besides its step's cost: well over the real sweep it wraps
# (one request of REAL_CONTEXT tokens on the tiny model, ~1 ms), so only the sleeps' jitter is
# left; 3 % of a candidate's sweeps (the tuner's margin) is ~5 ms
BASE_S = 0.05
REAL_CONTEXT = 64


@pytest.fixture(autouse=True)
def default_schedule_after() -> Any:
    yield
    native.set_kernel_schedule(DEFAULT.flat())


@dataclass
class SlowedAttention(AttentionWork):
    """The model's attention sweeps, each ending BASE_S plus its step's cost after it began
    (each runs the real kernel on one short request, whatever its size: the costs are set)."""

    costs: dict[int, float] = field(default_factory=dict)  # block tokens -> seconds

    def sweep(self, batch: int, context: int) -> Any:
        real = super().sweep(1, REAL_CONTEXT)
        module = native.load_kernels("paged_attention")

        def run() -> None:
            began = time.perf_counter()
            real()
            tokens = Schedule.from_flat(module.get_schedule()).attention_block_tokens
            time.sleep(max(0.0, began + BASE_S + self.costs.get(tokens, 0.0)
                           - time.perf_counter()))
        return run


def tuned_attention(int8_tiny_llama: Any, costs: dict[int, float]) -> tuple[TuneResult, Any]:
    """The attention classes alone (a model without packed weights), on slowed sweeps."""
    runner = int8_tiny_llama.runner
    real = attention_work(runner, runner.model)
    assert real is not None
    slowed = SlowedAttention(**{f.name: getattr(real, f.name) for f in fields(real)},
                             costs=costs)
    run = _Run(TuneResult(DEFAULT, []), {}, math.inf, lambda _: None)
    run.tune_all(StepWeights(), slowed, None)
    return run.result, run.new_entries


def blocking_name(entries: dict[str, Any]) -> str:
    (name,) = [n for n in entries if n.startswith("attention blocking ")]
    return name


def test_the_tuner_chooses_the_fastest_step(int8_tiny_llama: Any) -> None:
    result, entries = tuned_attention(int8_tiny_llama, {32: 0.05, 64: 0.05})
    name = blocking_name(entries)
    assert entries[name] == {"block_tokens": 128}
    assert result.schedule == replace(DEFAULT, attention_block_tokens=128,
                                      attention_hint=result.schedule.attention_hint)
    chosen = [row for row in result.rows if row.shape == name and row.is_chosen]
    assert [row.candidate for row in chosen] == ["128 keys a step"]
    assert {row.candidate for row in result.rows if row.shape == name} == {
        f"{tokens} keys a step" for tokens in ATTENTION_BLOCK_TOKENS}


def test_steps_that_time_alike_keep_the_default(int8_tiny_llama: Any) -> None:
    result, entries = tuned_attention(int8_tiny_llama, {})
    assert entries[blocking_name(entries)] == {"block_tokens": DEFAULT.attention_block_tokens}
    assert result.schedule.attention_block_tokens == DEFAULT.attention_block_tokens


def tune(int8_tiny_llama: Any, cache: Path) -> TuneResult:
    """A start in `cached` mode, with a budget no loaded machine exhausts on the tiny model."""
    runner = int8_tiny_llama.runner
    return tune_kernels(runner.model, runner, "cached", cache_dir=cache, log=lambda _: None,
                        budget_s=600.0)


def modules_run() -> list[list[int]]:
    return [native.load_kernels(k).get_schedule()
            for k in ("quant_matmul", "decode_layers", "paged_attention")]


def test_the_step_is_cached_kept_or_reverted_by_the_step_check(int8_tiny_llama: Any,
                                                               tmp_path: Path) -> None:
    first = tune(int8_tiny_llama, tmp_path)
    (kept,) = list(tmp_path.glob("*.json"))
    body = json.loads(kept.read_text())
    name = blocking_name(body["entries"])
    assert body["entries"][name]["block_tokens"] in ATTENTION_BLOCK_TOKENS
    # a cache from before the knob: its class alone is timed, the others read
    del body["entries"][name]
    kept.write_text(json.dumps(body))
    native.set_kernel_schedule(DEFAULT.flat())
    again = tune(int8_tiny_llama, tmp_path)
    assert {row.shape for row in again.rows} == {name}
    # (the step check's verdict holds for the tuned schedule, which the new timing may move)
    assert set(again.reused) >= {n for n in body["entries"] if " step " not in n} - {name}
    # a step of 128 keys, tuned: the step check judges it as its own group
    body = json.loads(kept.read_text())
    body["entries"][name] = {"block_tokens": 128}
    body["entries"] = {n: e for n, e in body["entries"].items() if " step " not in n}
    kept.write_text(json.dumps(body))
    check = tune(int8_tiny_llama, tmp_path).step_check
    assert check is not None and check.tuned_schedule.attention_block_tokens == 128
    assert "attention blocking" in changed_groups(check.tuned_schedule)
    assert "attention blocking" in check.kept_groups + check.reverted_groups
    assert group_value("attention blocking", check.tuned_schedule, []) == "128"
    # the verdict read back: kept, every module runs it; reverted, the built-in step runs
    body = json.loads(kept.read_text())
    (step_name,) = [n for n in body["entries"] if " step " in n]
    groups = check.kept_groups + check.reverted_groups
    for kept_groups, tokens in ((groups, 128), ([], DEFAULT.attention_block_tokens)):
        body["entries"][step_name].update(
            kept=kept_groups, reverted=[g for g in groups if g not in kept_groups])
        kept.write_text(json.dumps(body))
        native.set_kernel_schedule(DEFAULT.flat())
        result = tune(int8_tiny_llama, tmp_path)
        assert result.rows == [] and result.schedule.attention_block_tokens == tokens
        assert modules_run() == [result.schedule.flat()] * 3
    assert first.schedule.attention_block_tokens in ATTENTION_BLOCK_TOKENS


def test_a_schedule_from_before_the_knob_reads_with_its_default() -> None:
    other = replace(DEFAULT, attention_hint="nta", spin_us=5, attention_block_tokens=64)
    assert Schedule.from_flat(other.flat()) == other
    before = other.flat()[:-1]  # before delta_net_strip_columns (the last value)
    assert Schedule.from_flat(before) == other
    at = 2 * len(LAYOUTS) * len(ROW_CLASSES) + 1  # after attention_hint
    assert before[at] == 64
    del before[at]
    assert Schedule.from_flat(before) == replace(other, attention_block_tokens=32)
    strips = replace(other, delta_net_strip_columns=16)
    assert Schedule.from_flat(strips.flat()) == strips
    assert "DeltaNet strips of 16 columns" in strips.describe()
    assert "64 keys a step" in other.describe()

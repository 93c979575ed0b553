"""The step check (kernel_tuning/step_check.py) on a real model's decode steps: the steps leave
the KV cache as they found it; a group of knobs the steps refute is reverted while the others
stay; a confirmed schedule is kept whole; the verdict is cached and read back, and judged again
for another tuned schedule; `nanoserve tune` prints the step A/B.

Where a verdict must be known in advance, the real steps are slowed by a sleep that depends on
the schedule the kernel modules report running, so the check's timing, pairing and choosing
all run for real and only the costs are set by the test."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from nanoserve import native
from nanoserve.kernel_tuning.decode_steps import DecodeSteps, decode_steps
from nanoserve.kernel_tuning.report import format_step_check
from nanoserve.kernel_tuning.schedule import DEFAULT, Prefetch, Schedule
from nanoserve.kernel_tuning.step_check import (
    GROUPS,
    changed_groups,
    check_steps,
    confirm,
    with_groups,
)
from nanoserve.kernel_tuning.tuner import tune_kernels

# three groups changed: the 1-row prefetch of Q8_0's layout, the wide threshold, the
# attention's prefetch hint
TUNED = replace(DEFAULT.with_prefetch("S8H", 1, Prefetch("t0", 4096)), wide_min_rows=32,
                attention_hint="nta")
# what every slowed step lasts, besides its groups' costs (costs of 20 ms and more)
BASE_S = 0.05


@pytest.fixture(autouse=True)
def default_schedule_after() -> Any:
    yield
    native.set_kernel_schedule(DEFAULT.flat())


@dataclass
class Slowed:
    """Real decode steps, each followed by BASE_S and the cost of every group whose knobs the
    decode_layers module runs as TUNED sets them."""

    steps: DecodeSteps
    costs: dict[str, float]
    tuned: Schedule = TUNED

    @property
    def batches(self) -> list[int]:
        return self.steps.batches

    def run(self, batch: int) -> None:
        # each slowed step ends at a fixed time after it began, whatever the real step took
        # (well under BASE_S), so a loaded machine's noise on the tiny model cannot move a
        # verdict: only the sleeps' own jitter (~0.1 ms of 50) is left
        began = time.perf_counter()
        self.steps.run(batch)
        module = native.load_kernels("decode_layers")
        running = Schedule.from_flat(module.get_schedule())
        cost = BASE_S + sum(cost for group, cost in self.costs.items()
                            if with_groups(running, [group]) == with_groups(self.tuned, [group]))
        time.sleep(max(0.0, began + cost - time.perf_counter()))


def slowed_check(int8_tiny_llama: Any, costs: dict[str, float], tuned: Schedule = TUNED) -> Any:
    with decode_steps(int8_tiny_llama.runner, batches=(1, 8)) as steps:
        assert steps is not None
        return check_steps(tuned, Slowed(steps, costs, tuned), math.inf, rounds=7)


def test_the_groups_cover_every_knob() -> None:
    other = Schedule(tuple((Prefetch("t0", 2048), Prefetch("none", 0)) for _ in DEFAULT.weights),
                     "t2", 64, 4, 8, 20, 4096, 128)
    assert with_groups(other, list(GROUPS)) == other
    assert with_groups(other, []) == DEFAULT
    assert changed_groups(TUNED) == ["prefetch at 1 row", "wide threshold",
                                     "attention prefetch"]


def test_the_steps_leave_the_cache_as_found(int8_tiny_llama: Any) -> None:
    runner = int8_tiny_llama.runner
    for pair in runner.kv_slot_pairs:  # a cache holding something, not zeros
        for tensor in pair:
            tensor.copy_(torch.rand_like(tensor.float()).to(tensor.dtype))
    before = [t.clone() for pair in runner.kv_slot_pairs for t in pair]
    with decode_steps(runner) as steps:
        assert steps is not None and steps.batches == [1, 8, 32]
        steps.prepare()
        for batch in steps.batches:
            steps.run(batch)
        during = [t.clone() for pair in runner.kv_slot_pairs for t in pair]
    after = [t for pair in runner.kv_slot_pairs for t in pair]
    assert any(not torch.equal(a, b) for a, b in zip(before, during, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for tensor in after:
        tensor.zero_()


def test_a_group_the_steps_refute_is_reverted(int8_tiny_llama: Any) -> None:
    check = slowed_check(int8_tiny_llama, {"prefetch at 1 row": -0.025, "attention prefetch": 0.05})
    assert check.kept_groups == ["prefetch at 1 row"]
    assert sorted(check.reverted_groups) == ["attention prefetch", "wide threshold"]
    assert check.schedule == DEFAULT.with_prefetch("S8H", 1, Prefetch("t0", 4096))
    assert max(check.tuned.ratios) > 1.1  # the whole tuned schedule was slower
    assert all(r < 1 for r in check.kept.ratios)
    assert Schedule.from_flat(native.load_kernels("decode_layers").get_schedule()) == DEFAULT
    text = "\n".join(format_step_check(check, ["S8H"]))
    assert "| batch | built-in | kept | kept speed |" in text  # the partial keep's own A/B
    assert "reverted to the built-in: attention prefetch nta (built-in t1)" in text
    assert "kept: prefetch at 1 row S8H T0 4 KB (built-in S8H NTA 1 KB)" in text


def test_the_groups_confirmed_alone_are_kept_together(int8_tiny_llama: Any) -> None:
    check = slowed_check(int8_tiny_llama, {"prefetch at 1 row": -0.02, "wide threshold": -0.02,
                                  "attention prefetch": 0.05})
    assert sorted(check.kept_groups) == ["prefetch at 1 row", "wide threshold"]
    assert check.reverted_groups == ["attention prefetch"]


def test_a_confirmed_schedule_is_kept_whole_and_a_refuted_one_not_at_all(
        int8_tiny_llama: Any) -> None:
    faster = slowed_check(int8_tiny_llama, {"wide threshold": -0.025})
    assert faster.schedule == TUNED and faster.reverted_groups == []
    slower = slowed_check(int8_tiny_llama, {"attention prefetch": 0.05}, replace(DEFAULT,
                                                                         attention_hint="nta"))
    assert slower.schedule == DEFAULT and slower.reverted_groups == ["attention prefetch"]


def test_an_attention_step_the_steps_refute_is_reverted_and_one_they_confirm_kept(
        int8_tiny_llama: Any) -> None:
    """The walk step of decode attention (attention_block_tokens) is a group of its own."""
    blocked = replace(DEFAULT, wide_min_rows=32, attention_block_tokens=128)
    assert changed_groups(blocked) == ["wide threshold", "attention blocking"]
    refuted = slowed_check(int8_tiny_llama, {"wide threshold": -0.025,
                                             "attention blocking": 0.05}, blocked)
    assert refuted.kept_groups == ["wide threshold"]
    assert refuted.schedule == replace(DEFAULT, wide_min_rows=32)
    text = "\n".join(format_step_check(refuted, ["S8H"]))
    assert "attention blocking 128 (built-in 32)" in text
    alone = replace(DEFAULT, attention_block_tokens=64)
    confirmed = slowed_check(int8_tiny_llama, {"attention blocking": -0.025}, alone)
    assert confirmed.kept_groups == ["attention blocking"] and confirmed.schedule == alone


def test_a_check_of_the_builtin_schedule_times_it_once_a_batch(int8_tiny_llama: Any) -> None:
    check = slowed_check(int8_tiny_llama, {}, DEFAULT)  # (`nanoserve tune` where nothing was tuned)
    assert check.kept_groups == check.reverted_groups == [] and check.schedule == DEFAULT
    assert len(check.builtin.seconds) == len(check.tuned.ratios) == len(check.batches) == 2


def test_a_check_past_its_deadline_runs_the_builtin_schedule(int8_tiny_llama: Any) -> None:
    runner = int8_tiny_llama.runner
    assert confirm(TUNED, runner, None, 0.0, is_forced=False, log=lambda _: None) == (DEFAULT, None)


def tune(int8_tiny_llama: Any, mode: str, cache: Path) -> Any:
    runner = int8_tiny_llama.runner
    return tune_kernels(runner.model, runner, mode, cache_dir=cache, log=lambda _: None)


def test_the_verdict_is_cached_and_read_back(int8_tiny_llama: Any, tmp_path: Path) -> None:
    tune(int8_tiny_llama, "cached", tmp_path)
    (kept,) = list(tmp_path.glob("*.json"))
    body = json.loads(kept.read_text())
    name = next(n for n in body["entries"] if " weights S8H 1 row" in n)
    body["entries"][name] = {"hint": "t0", "bytes": 4096}  # a tuned choice, whatever ran
    body["entries"] = {n: e for n, e in body["entries"].items() if " step " not in n}
    kept.write_text(json.dumps(body))
    first = tune(int8_tiny_llama, "cached", tmp_path)
    check = first.step_check
    assert check is not None and not check.is_cached and check.batches == [1, 8, 32]
    assert "prefetch at 1 row" in check.kept_groups + check.reverted_groups
    (step_name,) = [n for n in json.loads(kept.read_text())["entries"] if " step " in n]
    # the next start reads the verdict: nothing timed, the same schedule
    native.set_kernel_schedule(DEFAULT.flat())
    second = tune(int8_tiny_llama, "cached", tmp_path)
    assert second.step_check is not None and second.step_check.is_cached
    assert second.rows == [] and second.schedule == first.schedule
    # a verdict read, not timed: one that keeps everything runs the tuned schedule
    body = json.loads(kept.read_text())
    groups = check.kept_groups + check.reverted_groups
    body["entries"][step_name].update(kept=groups, reverted=[])
    kept.write_text(json.dumps(body))
    assert tune(int8_tiny_llama, "cached", tmp_path).schedule == check.tuned_schedule
    # another tuned schedule is judged again
    body["entries"][name] = {"hint": "t2", "bytes": 512}
    kept.write_text(json.dumps(body))
    again = tune(int8_tiny_llama, "cached", tmp_path).step_check
    assert again is not None and not again.is_cached
    assert again.tuned_schedule.prefetch("S8H", 1) == Prefetch("t2", 512)


def test_a_check_no_start_can_finish_is_not_tried_at_every_start(int8_tiny_llama: Any,
                                                                  tmp_path: Path) -> None:
    """A start whose classes all come from the cache gives the check the whole budget; if it
    still cannot finish (a large model's steps), later starts run the built-in schedule
    without timing it again, and `nanoserve tune` (force) checks it."""
    runner = int8_tiny_llama.runner
    tune(int8_tiny_llama, "cached", tmp_path)
    (kept,) = list(tmp_path.glob("*.json"))
    body = json.loads(kept.read_text())
    name = next(n for n in body["entries"] if " weights S8H 1 row" in n)
    body["entries"][name] = {"hint": "t0", "bytes": 4096}  # a tuned choice to check
    body["entries"] = {n: e for n, e in body["entries"].items() if " step " not in n}
    kept.write_text(json.dumps(body))
    cut = tune_kernels(runner.model, runner, "cached", cache_dir=tmp_path, budget_s=1e-9,
                       log=lambda _: None)
    assert cut.schedule == DEFAULT and cut.step_check is None
    (step_name,) = [n for n in json.loads(kept.read_text())["entries"] if " step " in n]
    assert json.loads(kept.read_text())["entries"][step_name]["unchecked"] is True
    later = tune(int8_tiny_llama, "cached", tmp_path)  # the whole budget, and still not timed
    assert later.schedule == DEFAULT and later.step_check is None and later.rows == []
    assert step_name in later.reused
    forced = tune(int8_tiny_llama, "force", tmp_path)
    assert forced.step_check is not None and not forced.step_check.is_cached


def test_the_tune_command_prints_the_step_ab(tiny_model_dir: Any) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nanoserve.entrypoints.cli", "tune",
         str(tiny_model_dir("llama")), "--quantization", "int8", "--device", "cpu"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    header = "| batch | built-in | tuned | tuned speed |"
    assert header in lines
    rows = lines[lines.index(header) + 2 : lines.index(header) + 5]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 8", "| 32"]
    assert all(row.count(" ms ") == 2 and row.endswith("x |") for row in rows)
    assert any(line.startswith("runs: the ") for line in lines)
    assert "on whole decode steps" in done.stderr

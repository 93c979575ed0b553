"""The kernel tuner: at a model's first start on a machine, time the schedule's candidates on
the model's own work and run the fastest; later starts read the choices from the cache.

`tune_kernels(model, runner, mode)` builds the schedule this process runs and sets it in every
kernel module (`native.set_kernel_schedule`). Per shape class (tune_cache.py keeps one entry
each):

- the pairs kernel (avx512 and amx tiers): from how many rows two 8-row groups in a 512-bit
  register beat one group in a 256-bit one where the weights stream (few rows);
- the tiles (amx tier): from how many rows AMX tile products beat the avx512 kernels;
- weights, per packed layout at 1 row and at 8: the prefetch hint and distance of the streamed
  weights (first each hint at two distances, then the best hint's distances);
- the wide threshold: from how many rows the wide form / pairs kernel beats streaming;
- decode attention: the hint of the KV rows' prefetch, at one long context and 8 short ones;
  then the keys its walk reads a step (1, 2 or 4 tiles; the 32-key tile, and so every bit,
  stays), at those and at a batch of 32 short contexts;
- the DeltaNet strips (hybrid models): how many value columns the recurrence carries through
  a sequence's tokens at once, at 8 decodes and a prefill chunk;
- the tier, where the CPU runs more than one and `NANOSERVE_CPU_ISA` leaves it open: the tier
  measured faster on the model's weights at 1 and 64 rows runs from the next start (a process
  runs one tier, chosen before its first kernel loads: `preferred_tier`).

Then the step check (step_check.py): the tuned schedule against the built-in one on whole
decode steps, each group of choices kept only where the steps confirm it; its verdict is cached.

Modes (`--kernel-tuning`): `cached` (the default: what the cache holds, timing only what it
lacks), `force` (time every class again), `off` (today's constants, for A/B runs; also what
the `amx-emu` tier runs, whose emulated tiles' times mean nothing). Timing is
interleaved (`timing.py`) and bounded: past `budget_s` the classes not yet timed keep their
defaults and are not cached. No schedule changes an output: only its speed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

import nanoserve.native as native
from nanoserve.kernel_tuning.result import Row, TuneResult
from nanoserve.kernel_tuning.schedule import (
    AMX_MIN_ROWS,
    DEFAULT,
    PAIRS_MIN_ROWS,
    PREFETCH_BYTES,
    PREFETCH_HINTS,
    ROW_CLASSES,
    WIDE_MIN_ROWS,
    Prefetch,
)
from nanoserve.kernel_tuning.step_check import (
    confirm,
    is_unchecked,
    step_entry_name,
    unchecked_entry,
)
from nanoserve.kernel_tuning.swept_knobs import SweptKnob, swept_knobs
from nanoserve.kernel_tuning.timing import Timed, best_threshold, choose, time_interleaved
from nanoserve.kernel_tuning.tune_cache import cache_file, machine_key, read_entries, write_entries
from nanoserve.kernel_tuning.workloads import (
    AttentionWork,
    DeltaNetWork,
    StepWeights,
    attention_work,
    delta_net_work,
    l3_bytes,
    step_weights,
)

logger = logging.getLogger("nanoserve")

MODES = ("cached", "force", "off")
BUDGET_S = 60.0
ROUNDS = 4
_STREAMING = 1 << 30  # a wide threshold no step reaches: every matmul streams
_WIDE_ROWS = (16, 24, 32, 48, 64, 128)  # where the wide threshold is measured
_TIER_ROWS = (1, 64)


def preferred_tier(mode: str, cache_dir: Path | None = None) -> str | None:
    """The cached tier choice for this machine, to give `native.prefer_tier` before the first
    kernel loads (None: none cached, or `mode` is not `cached`)."""
    if mode != "cached" or native.tier_is_forced():
        return None
    key = machine_key(torch.get_num_threads(), native.kernel_build_id())
    entry = read_entries(cache_file(cache_dir or _cache_dir(), key), key).get("tier")
    return entry.get("tier") if entry else None


def tune_kernels(model: Any, runner: Any, mode: str = "cached", *, budget_s: float = BUDGET_S,
                 log: Callable[[str], None] = logger.info,
                 cache_dir: Path | None = None) -> TuneResult:
    """Set the schedule for this process's kernels (see the module); what it did.
    `cache_dir`: where the choices are kept (default: the user's cache, `tune/`)."""
    if mode not in MODES:
        raise ValueError(f"kernel tuning {mode!r} is not one of {list(MODES)}")
    # 1) each shape class from the cache, or timed alone
    step = step_weights(model)
    result = TuneResult(DEFAULT, step.layouts)
    if mode == "off" or native.loaded_tier() == "amx-emu":  # (the emulator's times mean nothing)
        native.set_kernel_schedule(DEFAULT.flat())
        return result
    started = time.monotonic()
    key = machine_key(torch.get_num_threads(), native.kernel_build_id())
    path = cache_file(cache_dir or _cache_dir(), key)
    cached = read_entries(path, key) if mode == "cached" else {}
    run = _Run(result, cached, started + budget_s, log)
    run.tune_all(step, attention_work(runner, model), delta_net_work(runner, model))
    # 2) the classes' choices, kept where whole steps confirm them (step_check.py)
    tuned, name = result.schedule, step_entry_name(runner, run.tier, step.layouts)
    result.schedule, result.step_check = confirm(tuned, runner, cached.get(name), run.deadline,
                                                 is_forced=mode == "force", log=log)
    if result.step_check is not None:
        if result.step_check.is_cached:
            result.reused.append(name)
        else:
            run.new_entries[name] = result.step_check.to_entry()
    elif is_unchecked(cached.get(name) or {}, tuned):
        result.reused.append(name)  # no start finishes this check: the built-in runs
    elif tuned != DEFAULT:
        result.skipped.append(name)  # past the budget: the built-in runs, checked next time
        if not run.new_entries and mode == "cached" and budget_s > 0:  # the whole budget
            run.new_entries[name] = unchecked_entry(tuned)
    if run.new_entries:
        write_entries(path, key, run.new_entries)
    native.set_kernel_schedule(result.schedule.flat())
    result.seconds = time.monotonic() - started
    if run.new_entries:
        log(f"kernel tuning: {len(run.new_entries)} choices timed in "
            f"{result.seconds:.1f} s, kept in {path}")
    return result


def _cache_dir() -> Path:
    return native.user_cache_dir() / "tune"


@dataclass(frozen=True)
class _Class:
    """A shape class: its cache entry's name, how to time it, how to apply an entry."""

    name: str
    measure: Callable[[], dict[str, Any]]
    apply: Callable[[dict[str, Any]], None]


class _Run:
    """One tuning run: the classes in order, each from the cache or timed."""

    def __init__(self, result: TuneResult, cached: dict[str, dict[str, Any]], deadline: float,
                 log: Callable[[str], None]) -> None:
        self.result = result
        self.cached = cached
        self.deadline = deadline
        self.log = log
        self.new_entries: dict[str, dict[str, Any]] = {}
        self.tier = native.loaded_tier() or "no-matmul"  # a model without packed weights

    def tune_all(self, step: StepWeights, attention: AttentionWork | None,
                 delta: DeltaNetWork | None) -> None:
        for i, shape in enumerate(classes := self._classes(step, attention, delta), 1):
            entry = self.cached.get(shape.name)
            if entry is not None and self._applies(shape.apply, entry):
                self.result.reused.append(shape.name)
                continue
            if time.monotonic() > self.deadline:
                self.result.skipped.append(shape.name)
                continue
            self.log(f"kernel tuning for this CPU ({i}/{len(classes)}): {shape.name}")
            entry = shape.measure()
            self.new_entries[shape.name] = entry
            shape.apply(entry)

    def _classes(self, step: StepWeights, attention: AttentionWork | None,
                 delta: DeltaNetWork | None) -> list[_Class]:
        """The model's shape classes, in the order they are tuned (each builds on those
        before: the wide threshold is timed with the tuned prefetch)."""
        # where a step's weights come from: DRAM, or caches that hold them all (a server L3)
        where = "dram" if step.num_bytes > (l3_bytes() or 32 << 20) else "cache"
        classes = []
        if step.weights and self.tier in ("avx512", "amx"):
            name = f"{self.tier} pairs {'+'.join(step.layouts)} {where}"
            classes.append(_Class(name, partial(self._pairs, step, name), self._set_pairs))
        if step.weights and self.tier == "amx":
            name = f"{self.tier} tiles {'+'.join(step.layouts)} {where}"
            classes.append(_Class(name, partial(self._tiles, step, name), self._set_tiles))
        for layout in step.layouts:
            for rows in ROW_CLASSES:
                name = f"{self.tier} weights {layout} {_row_label(rows)} {where}"
                classes.append(_Class(name, partial(self._prefetch, step, layout, rows, name),
                                      partial(self._set_prefetch, layout, rows)))
        if step.weights:
            name = f"{self.tier} wide {'+'.join(step.layouts)} {where}"
            classes.append(_Class(name, partial(self._wide, step, name), self._set_wide))
        for knob in swept_knobs(attention, delta):
            classes.append(_Class(knob.name, partial(self._knob, knob), partial(self._set, knob)))
        if (step.weights and len(native.available_auto_tiers()) > 1
                and not native.tier_is_forced()):
            classes.append(_Class("tier", partial(self._tier, step), self._set_tier))
        return classes

    def _applies(self, apply: Callable[[dict[str, Any]], None], entry: dict[str, Any]) -> bool:
        """Apply a cached entry; False (and a new timing) for one this version cannot read."""
        try:
            apply(entry)
        except (KeyError, TypeError, ValueError):
            return False
        return True

    # -- weights: the prefetch of one layout at one row class -----------------------------------
    def _prefetch(self, step: StepWeights, layout: str, rows: int, name: str) -> dict[str, Any]:
        sweep = step.sweep(rows)
        default = DEFAULT.prefetch(layout, rows)
        base = self.result.schedule

        def run(candidate: Prefetch) -> None:
            native.set_kernel_schedule(base.with_prefetch(layout, rows, candidate).flat())
            sweep()

        # each hint at two distances, then the best hint's distances against it and the default
        first = _unique([Prefetch("none", 0), default,
                         *(Prefetch(h, b) for h in PREFETCH_HINTS for b in (1024, 8192))])
        timed = time_interleaved(first, run, ROUNDS)
        best = min(timed, key=lambda t: t.seconds).candidate
        final = timed
        if best.hint != "none":
            final = time_interleaved(_unique([*(Prefetch(best.hint, b) for b in PREFETCH_BYTES),
                                              best, default]), run, ROUNDS)
            again = {t.candidate for t in final}
            timed = final + [t for t in timed if t.candidate not in again]
        chosen = choose(final, default)
        self._rows(name, timed, chosen, lambda t: f"{step.num_bytes / t / 1e9:.1f} GB/s",
                   lambda c: c.label)
        native.set_kernel_schedule(base.flat())
        return {"hint": chosen.hint, "bytes": chosen.bytes}

    def _set_prefetch(self, layout: str, rows: int, entry: dict[str, Any]) -> None:
        prefetch = Prefetch(str(entry["hint"]), int(entry["bytes"]))
        self.result.schedule = self.result.schedule.with_prefetch(layout, rows, prefetch)

    # -- the pairs kernel's threshold (avx512) ----------------------------------------------------
    def _pairs(self, step: StepWeights, name: str) -> dict[str, Any]:
        base = self.result.schedule
        single = DEFAULT.pairs_min_rows
        pairs: dict[int, float] = {}
        one: dict[int, float] = {}
        for rows in (1, 2, 4, 8):
            sweep = step.sweep(rows)

            def run(threshold: int, sweep: Callable[[], None] = sweep) -> None:
                native.set_kernel_schedule(replace(base, pairs_min_rows=threshold).flat())
                sweep()

            timed = time_interleaved([1, single], run, ROUNDS)
            pairs[rows], one[rows] = (t.seconds for t in timed)
            self.result.rows += [Row(f"{name} at {_row_label(rows)}", label, t.seconds,
                                     f"{step.num_bytes / t.seconds / 1e9:.1f} GB/s", False)
                                 for label, t in (("pairs (512-bit)", timed[0]),
                                                  ("one group (256-bit)", timed[1]))]
        threshold = best_threshold(PAIRS_MIN_ROWS, pairs, one, single)
        native.set_kernel_schedule(base.flat())
        self.result.rows.append(Row(name, f"pairs from {threshold} rows", 0.0, "", True))
        return {"pairs_min_rows": threshold}

    def _set_pairs(self, entry: dict[str, Any]) -> None:
        self.result.schedule = replace(self.result.schedule,
                                       pairs_min_rows=int(entry["pairs_min_rows"]))

    # -- the amx tier's tiles: from how many rows ------------------------------------------------
    def _tiles(self, step: StepWeights, name: str) -> dict[str, Any]:
        base = self.result.schedule
        never = 1 << 30
        tiles: dict[int, float] = {}
        vectors: dict[int, float] = {}
        for rows in (4, 8, 16, 32, 64):
            sweep = step.sweep(rows)

            def run(threshold: int, sweep: Callable[[], None] = sweep) -> None:
                native.set_kernel_schedule(replace(base, amx_min_rows=threshold).flat())
                sweep()

            timed = time_interleaved([1, never], run, ROUNDS)
            tiles[rows], vectors[rows] = (t.seconds for t in timed)
            self.result.rows += [Row(f"{name} at {_row_label(rows)}", label, t.seconds,
                                     f"{step.macs(rows) / t.seconds / 1e9:.0f} GMAC/s", False)
                                 for label, t in (("tiles", timed[0]), ("avx512", timed[1]))]
        threshold = best_threshold(AMX_MIN_ROWS, tiles, vectors, DEFAULT.amx_min_rows)
        native.set_kernel_schedule(base.flat())
        self.result.rows.append(Row(name, f"tiles from {threshold} rows", 0.0, "", True))
        return {"amx_min_rows": threshold}

    def _set_tiles(self, entry: dict[str, Any]) -> None:
        self.result.schedule = replace(self.result.schedule,
                                       amx_min_rows=int(entry["amx_min_rows"]))

    # -- the wide threshold ---------------------------------------------------------------------
    def _wide(self, step: StepWeights, name: str) -> dict[str, Any]:
        base = self.result.schedule
        wide: dict[int, float] = {}
        streaming: dict[int, float] = {}
        for rows in _WIDE_ROWS:
            sweep = step.sweep(rows)

            def run(threshold: int, sweep: Callable[[], None] = sweep) -> None:
                native.set_kernel_schedule(replace(base, wide_min_rows=threshold).flat())
                sweep()

            timed = time_interleaved([WIDE_MIN_ROWS[0], _STREAMING], run, ROUNDS)
            wide[rows], streaming[rows] = (t.seconds for t in timed)
            macs = step.macs(rows)
            self.result.rows += [Row(f"{name} at {rows} rows", label, t.seconds,
                                     f"{macs / t.seconds / 1e9:.0f} GMAC/s", False)
                                 for label, t in (("wide form / pairs", timed[0]),
                                                  ("streaming", timed[1]))]
        threshold = best_threshold(WIDE_MIN_ROWS, wide, streaming, DEFAULT.wide_min_rows)
        native.set_kernel_schedule(base.flat())
        self.result.rows.append(Row(name, f"wide from {threshold} rows", 0.0, "", True))
        return {"wide_min_rows": threshold}

    def _set_wide(self, entry: dict[str, Any]) -> None:
        self.result.schedule = replace(self.result.schedule,
                                       wide_min_rows=int(entry["wide_min_rows"]))

    # -- a knob timed on its own sweeps (swept_knobs.py) --------------------------------------
    def _knob(self, knob: SweptKnob) -> dict[str, Any]:
        base = self.result.schedule
        runs = [make() for make in knob.sweeps]  # (the inputs made once, outside the timing)

        def run(value: Any) -> None:
            native.set_kernel_schedule(replace(base, **{knob.field: value}).flat())
            for sweep in runs:
                sweep()

        timed = time_interleaved(list(knob.candidates), run, ROUNDS)
        chosen = choose(timed, getattr(DEFAULT, knob.field))
        self._rows(knob.name, timed, chosen,
                   lambda t: f"{knob.num_bytes / t / 1e9:.1f} GB/s", knob.label)
        native.set_kernel_schedule(base.flat())
        return {knob.entry_key: chosen}

    def _set(self, knob: SweptKnob, entry: dict[str, Any]) -> None:
        value = entry[knob.entry_key]
        if not isinstance(value, type(getattr(DEFAULT, knob.field))):
            raise ValueError(f"{knob.entry_key} {value!r} in the cache")
        self.result.schedule = replace(self.result.schedule, **{knob.field: value})

    # -- the tier (from the next start) ---------------------------------------------------------
    def _tier(self, step: StepWeights) -> dict[str, Any]:
        tiers = native.available_auto_tiers()
        modules = {t: native.load_kernels("quant_matmul", t) for t in tiers}
        sweeps = {t: [step.sweep(rows, modules[t]) for rows in _TIER_ROWS]
                  for t in tiers if modules[t] is not None}

        def run(tier: str) -> None:
            for sweep in sweeps[tier]:
                sweep()

        timed = time_interleaved(list(sweeps), run, ROUNDS)
        chosen = choose(timed, self.tier)
        self._rows("tier (1 and 64 rows)", timed, chosen, lambda t: "", str)
        return {"tier": chosen}

    def _set_tier(self, entry: dict[str, Any]) -> None:
        tier = str(entry["tier"])
        if tier not in native.TIERS:
            raise ValueError(f"no tier {tier!r}")
        self.result.tier, self.result.tier_running = tier, self.tier
        if tier != self.tier:
            self.log(f"kernel tuning: the {tier} tier measured faster on this CPU than "
                     f"{self.tier}; it runs from the next start")

    def _rows(self, shape: str, timed: list[Timed[Any]], chosen: Any,
              rate: Callable[[float], str], label: Callable[[Any], str]) -> None:
        for t in sorted(timed, key=lambda t: t.seconds):
            self.result.rows.append(Row(shape, label(t.candidate), t.seconds, rate(t.seconds),
                                        t.candidate == chosen))


def _row_label(count: int) -> str:
    return "1 row" if count == 1 else f"{count} rows"


def _unique(candidates: list[Any]) -> list[Any]:
    return list(dict.fromkeys(candidates))

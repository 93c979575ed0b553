"""The step check: a tuned choice keeps its place only where whole decode steps confirm it.

The tuner times each shape class alone (tuner.py); a serving step runs them together, in the
one-region layer stack where the runner uses it, beside other caches' bytes and the threads'
handoffs, and a choice that wins alone can lose there (a 2-core Zen 3: the tuned server at
0.91x the built-in one's, docs/benchmarks.md). So the tuned schedule is timed against the
built-in one (`DEFAULT`, what `--kernel-tuning off` runs) on whole decode steps of the model
runner at batch 1, 8 and 32 (decode_steps.py), interleaved, each round's steps paired:

1) the whole tuned schedule against DEFAULT: kept if confirmed;
2) else, where it changes more than one group of knobs (`GROUPS`), each group alone over
   DEFAULT; the groups confirmed alone go on;
3) more than one: all of them together, against DEFAULT and the best alone, once more; the
   confirmed one of the two with the faster steps is kept.

Confirmed: at no batch size more than `SLOWER` slower than DEFAULT (the median of the rounds'
ratios), and on the batch sizes' mean at least `GAIN` faster; within noise, the built-in stays.
The verdict is cached beside the classes (an entry named for the model's step, holding the
tuned schedule it judged), so a later start with the same classes times nothing; a check cut
short by the budget runs DEFAULT and runs again at the next start, unless it had the whole
budget (every class from the cache): then later starts run DEFAULT without trying again
(`unchecked_entry`), and `nanoserve tune` checks it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import nanoserve.native as native
from nanoserve.kernel_tuning.decode_steps import decode_steps
from nanoserve.kernel_tuning.schedule import DEFAULT, LAYOUTS, Schedule
from nanoserve.kernel_tuning.timing import time_rounds

SLOWER = 0.015  # slower than this at any batch size: refuted (the goal: never below 0.97x)
GAIN = 0.01  # faster than this on the mean: confirmed
ROUNDS = 11
MIN_SAMPLE_S = 0.03  # steps per sample, so that a sample outlasts the timer's and OS's jitter
MAX_STEPS_PER_SAMPLE = 16

Take = Callable[[Schedule, Schedule], Schedule]  # (into, source): into with a group's knobs


def _prefetch_at(row_class: int) -> Take:
    def take(into: Schedule, source: Schedule) -> Schedule:
        weights = tuple(tuple(s[k] if k == row_class else p for k, p in enumerate(w))
                        for w, s in zip(into.weights, source.weights, strict=True))
        return replace(into, weights=weights)
    return take


def _knob(name: str) -> Take:
    return lambda into, source: replace(into, **{name: getattr(source, name)})


# the knobs a step check keeps or reverts together: every layout's prefetch at one row class
# (one row streams alone; more rows share the tiles), then each threshold, hint and split
_KNOBS = {"wide threshold": "wide_min_rows", "pairs threshold": "pairs_min_rows",
          "tiles threshold": "amx_min_rows", "attention prefetch": "attention_hint",
          "attention blocking": "attention_block_tokens", "barrier spin": "spin_us",
          "task grain": "grain_bytes", "delta net strips": "delta_net_strip_columns"}
GROUPS: dict[str, Take] = {"prefetch at 1 row": _prefetch_at(0),
                           "prefetch at 2+ rows": _prefetch_at(1),
                           **{name: _knob(knob) for name, knob in _KNOBS.items()}}


def with_groups(tuned: Schedule, groups: list[str]) -> Schedule:
    """DEFAULT with `groups`' knobs taken from `tuned`."""
    schedule = DEFAULT
    for name in groups:
        schedule = GROUPS[name](schedule, tuned)
    return schedule


def changed_groups(tuned: Schedule) -> list[str]:
    """The groups whose knobs `tuned` sets otherwise than DEFAULT."""
    return [name for name in GROUPS if with_groups(tuned, [name]) != DEFAULT]


def group_value(name: str, schedule: Schedule, layouts: list[str]) -> str:
    """A group's knobs in `schedule`, for the report ("U4H T0 4 KB" or "32")."""
    if name in _KNOBS:
        return str(getattr(schedule, _KNOBS[name]))
    row_class = 0 if name.endswith("1 row") else 1
    return ", ".join(f"{layout} {schedule.weights[LAYOUTS.index(layout)][row_class].label}"
                     for layout in layouts)


@dataclass(frozen=True)
class Timing:
    """A candidate's steps, per batch size: the median step, and the median over the rounds
    of its step's ratio to DEFAULT's of the same round."""

    seconds: tuple[float, ...]
    ratios: tuple[float, ...]

    @property
    def is_confirmed(self) -> bool:
        return max(self.ratios) <= 1 + SLOWER and statistics.fmean(self.ratios) <= 1 - GAIN


class Steps(Protocol):
    """Whole steps to time (decode_steps.DecodeSteps, or a test's wrapper of one)."""

    @property
    def batches(self) -> list[int]: ...

    def run(self, batch: int) -> None: ...


@dataclass
class StepCheck:
    """A step check's verdict: the step A/B that `nanoserve tune` prints, and what it kept."""

    batches: list[int]
    builtin: Timing  # DEFAULT and the tuned schedule, timed together first
    tuned: Timing
    kept_builtin: Timing  # DEFAULT and the schedule kept, timed together last
    kept: Timing
    kept_groups: list[str]
    reverted_groups: list[str]
    tuned_schedule: Schedule
    is_cached: bool = False

    @property
    def schedule(self) -> Schedule:
        """The schedule kept: DEFAULT with the kept groups' knobs from the tuned one."""
        return with_groups(self.tuned_schedule, self.kept_groups)

    def to_entry(self) -> dict[str, Any]:
        """The cache entry: the verdict, and the tuned schedule it holds for."""
        return {"tuned": self.tuned_schedule.flat(), "kept": self.kept_groups,
                "reverted": self.reverted_groups, "batches": self.batches,
                **{f"{name}_{part}": list(getattr(getattr(self, name), part))
                   for name in _TIMINGS for part in ("seconds", "ratios")}}

    @classmethod
    def from_entry(cls, entry: dict[str, Any], tuned: Schedule) -> StepCheck | None:
        """The cached verdict, or None where it judged another tuned schedule."""
        if [int(v) for v in entry["tuned"]] != tuned.flat():
            return None
        kept, reverted = [str(g) for g in entry["kept"]], [str(g) for g in entry["reverted"]]
        if sorted(kept + reverted) != sorted(changed_groups(tuned)):
            raise ValueError("the entry's groups are not the schedule's")
        builtin, tuned_timing, kept_builtin, kept_timing = (
            Timing(tuple(float(s) for s in entry[f"{name}_seconds"]),
                   tuple(float(r) for r in entry[f"{name}_ratios"])) for name in _TIMINGS)
        return cls([int(b) for b in entry["batches"]], builtin, tuned_timing, kept_builtin,
                   kept_timing, kept, reverted, tuned, is_cached=True)


_TIMINGS = ("builtin", "tuned", "kept_builtin", "kept")


def check_steps(tuned: Schedule, steps: Steps, deadline: float,
                rounds: int = ROUNDS) -> StepCheck | None:
    """`tuned` against DEFAULT on `steps` (see the module); None where the deadline passed
    before the verdict. Leaves the kernels on DEFAULT's schedule."""
    groups = changed_groups(tuned)
    seen: dict[Schedule, tuple[Timing, Timing]] = {}  # (DEFAULT's, its own) timed together

    def timed(candidates: list[Schedule]) -> dict[Schedule, Timing] | None:
        timings = time_steps([DEFAULT, *candidates], steps, rounds, deadline)
        if timings is not None:
            seen.update({c: (timings[DEFAULT], t) for c, t in timings.items()})
        return timings

    first = timed([tuned])
    if first is None:
        return None
    kept = groups if first[tuned].is_confirmed or not groups else []
    if not kept and len(groups) > 1:
        chosen = _groups_alone(tuned, groups, timed)
        if chosen is None:
            return None
        kept = chosen
    native.set_kernel_schedule(DEFAULT.flat())
    final = with_groups(tuned, kept)
    return StepCheck(steps.batches, first[DEFAULT], first[tuned], *seen[final], kept,
                     [g for g in groups if g not in kept], tuned)


def _groups_alone(tuned: Schedule, groups: list[str],
                  timed: Callable[[list[Schedule]], dict[Schedule, Timing] | None]
                  ) -> list[str] | None:
    """Steps 2) and 3) of the module: the groups kept (None: past the deadline)."""
    alone = {name: with_groups(tuned, [name]) for name in groups}
    second = timed(list(alone.values()))
    if second is None:
        return None
    confirmed = sorted((g for g in groups if second[alone[g]].is_confirmed),
                       key=lambda g: statistics.fmean(second[alone[g]].ratios))
    if len(confirmed) <= 1:
        return confirmed
    together, best = with_groups(tuned, confirmed), alone[confirmed[0]]
    third = timed([together, best])
    if third is None:
        return None
    choices = [(third[s], kept) for s, kept in ((together, confirmed), (best, confirmed[:1]))
               if third[s].is_confirmed]
    return min(choices, key=lambda c: statistics.fmean(c[0].ratios))[1] if choices else []


def time_steps(candidates: list[Schedule], steps: Steps, rounds: int,
               deadline: float = math.inf) -> dict[Schedule, Timing] | None:
    """Each candidate's `Timing` against `candidates[0]` (DEFAULT), batch size by batch
    size, each sample a few steps (MIN_SAMPLE_S) after the schedule is set; None where the
    deadline passes before a batch size."""
    candidates = list(dict.fromkeys(candidates))  # (a check forced on DEFAULT: itself once)
    seconds: dict[Schedule, list[float]] = {c: [] for c in candidates}
    ratios: dict[Schedule, list[float]] = {c: [] for c in candidates}
    for batch in steps.batches:
        if time.monotonic() > deadline:
            return None
        repeats = _steps_per_sample(steps, batch)

        def run(schedule: Schedule, batch: int = batch, repeats: int = repeats) -> None:
            native.set_kernel_schedule(schedule.flat())
            for _ in range(repeats):
                steps.run(batch)

        samples = time_rounds(candidates, run, rounds)
        for candidate, own in zip(candidates, samples, strict=True):
            seconds[candidate].append(statistics.median(own) / repeats)
            ratios[candidate].append(statistics.median(
                a / b for a, b in zip(own, samples[0], strict=True)))
    return {c: Timing(tuple(seconds[c]), tuple(ratios[c])) for c in candidates}


def _steps_per_sample(steps: Steps, batch: int) -> int:
    native.set_kernel_schedule(DEFAULT.flat())
    steps.run(batch)  # (the first of a batch size builds its buffers)
    started = time.perf_counter()
    steps.run(batch)
    step = max(time.perf_counter() - started, 1e-6)
    return max(1, min(MAX_STEPS_PER_SAMPLE, math.ceil(MIN_SAMPLE_S / step)))


def unchecked_entry(tuned: Schedule) -> dict[str, Any]:
    """The entry of a check that a start with the whole budget could not finish (a large
    model's steps): later starts run DEFAULT without trying again; `nanoserve tune`, with its
    longer budget, checks it."""
    return {"tuned": tuned.flat(), "unchecked": True}


def is_unchecked(entry: dict[str, Any], tuned: Schedule) -> bool:
    try:
        return bool(entry.get("unchecked")) and [int(v) for v in entry["tuned"]] == tuned.flat()
    except (KeyError, TypeError, ValueError):
        return False


def step_entry_name(runner: Any, tier: str, layouts: list[str]) -> str:
    """The cache entry's name: what a step's time depends on beyond the machine's key."""
    arch = runner.model.arch
    path = "one region" if runner.plan.use_native_layers else "layer loop"
    kv = str(runner.kv_slot_pairs[0][0].dtype).removeprefix("torch.") \
        if runner.kv_slot_pairs else "no cache"
    return (f"{tier} step {arch.family} {arch.num_layers}x{arch.hidden_size}x"
            f"{arch.intermediate_size} vocab {arch.vocab_size} {'+'.join(layouts) or 'float'}"
            f" kv {kv} block {runner.block_size} {path}")


def confirm(tuned: Schedule, runner: Any, entry: dict[str, Any] | None, deadline: float,
            *, is_forced: bool, log: Callable[[str], None]) -> tuple[Schedule, StepCheck | None]:
    """The schedule to run and the check behind it: `entry`'s cached verdict where it judged
    `tuned`, else a new check (only where `tuned` is not DEFAULT, unless `is_forced`); DEFAULT
    where the check could not finish (past the deadline, or no step fits the cache)."""
    if entry is not None and is_unchecked(entry, tuned) and not is_forced:
        return DEFAULT, None  # a start could not finish it once: `nanoserve tune` checks it
    if entry is not None:
        try:
            cached = StepCheck.from_entry(entry, tuned)
        except (KeyError, TypeError, ValueError):  # written by another version: check again
            cached = None
        if cached is not None:
            return cached.schedule, cached
    if tuned == DEFAULT and not is_forced:
        return DEFAULT, None
    # no time left (a tensor-parallel rank's budget is none): the runner runs no step, which
    # on a rank would wait in an all-reduce for ranks that are not stepping
    if time.monotonic() >= deadline:
        return DEFAULT, None
    with decode_steps(runner) as steps:
        if steps is None:
            log("kernel tuning: no decode step fits the KV cache: the built-in schedule runs")
            return DEFAULT, None
        log(f"kernel tuning: the tuned schedule against the built-in one on whole decode "
            f"steps (batch {', '.join(map(str, steps.batches))}, context {steps.context})")
        steps.prepare()
        check = check_steps(tuned, steps, deadline)
    if check is None:
        log("kernel tuning: the step check ran past the time budget: the built-in schedule "
            "runs, and the check runs at the next start")
        return DEFAULT, None
    if check.reverted_groups:
        log(f"kernel tuning: the steps did not confirm {', '.join(check.reverted_groups)}: "
            "the built-in's run there")
    return check.schedule, check

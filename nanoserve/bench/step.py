"""`nanoserve bench step`: where one decode step's time goes.

A batch of requests is brought to the decoding state at a given context length; then a few
steps run under `torch.profiler` and every operator's own (self) CPU time is put in one bucket:

  matmuls      the projections and the LM head (oneDNN, MKL, the quantized kernels)
  attention    writing K/V into the cache, gathering it, and attending (SDPA or our kernel)
  element-wise every other operator inside the model's forward (norms, RoPE, SiLU, adds, copies)
  one region   the decoder layers where a few tokens run them as one native parallel region
               (csrc/team_forward.h): matmuls, attention and the rest, which the profiler
               cannot split
  model Python the forward's wall time not spent inside any operator: Python and dispatch
  sampler      the whole sampling call (its own operators and Python)
  engine       scheduling, input preparation and request updates: the rest of the step

`EngineCore.step` marks its phases with `record_function` scopes (`nanoserve.*`) for this.
The profiler adds a few microseconds per operator, so the buckets are scaled to the unprofiled
median step time, which is printed too.

After the buckets, each measured step beside its floor (floor.py): the bytes it must read over
the read bandwidth, its multiply-adds over the matmul kernel's rate, both measured in the run;
and beside the kernel's floor, the bytes over the rate the matmul reads the weights at itself.
The read rates are sampled between the timed steps (a drifting machine moves both), and the
kernels' schedule (kernel_tuning/) is printed above the tables.

`--compare-eager` times each batch size with the layers as one native call and as the Python
loop, interleaved (eager.py); `--compare-compiled` the same with the kernels' layer loop
under torch.compile in place of the Python loop (compiled.py).

`--rows-curve K` adds what speculative decoding needs to know: one request's step as it scores
1 + k rows (k draft tokens, k = 0..K), against the one-row step. The drafts are set on the
request before each step (a token that is always rejected), so every step scores all its rows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from nanoserve.bench.compiled import compare_compiled, format_compiled
from nanoserve.bench.eager import compare_eager, format_eager
from nanoserve.bench.floor import ReadProbe, format_floors, macs_per_s, step_floor
from nanoserve.bench.instruction_peak import format_peak, measure_peak
from nanoserve.bench.roofline import start_decoding
from nanoserve.bench.timing import median_seconds
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.native import loaded_tier

MATMUL_OPS = re.compile(r"mm$|addmm|linear|quant_matmul|linear_dynamic|_weight_int|matmul")
ATTENTION_OPS = re.compile(r"attention|index_select|index_copy|_softmax")
# "state update": a hybrid model's DeltaNet kernel (the conv and the recurrence over each
# sequence's states, model/delta_net_ops.py), shown where it ran
BUCKETS = ("matmuls", "attention", "state update", "element-wise", "one region",
           "model Python", "sampler", "engine")


@dataclass
class StepProfile:
    batch: int
    step_seconds: float  # unprofiled median
    buckets: dict[str, float] = field(default_factory=dict)  # seconds, scaled to step_seconds

    def share(self, bucket: str) -> float:
        return self.buckets[bucket] / self.step_seconds


def profile_decode_step(engine: EngineCore, batch: int, context_len: int,
                        repeats: int = 10, probe: ReadProbe | None = None) -> StepProfile:
    """`probe`: sampled between the timed steps (after each, the next step is run once
    untimed, so that every timed step follows a step, as in a server)."""
    ids = start_decoding(engine, batch, context_len, 3 * repeats + 3, "profile")
    step_seconds = median_seconds(engine.step, repeats) if probe is None \
        else _steps_beside(engine, repeats, probe)
    with without_usdt_lines():
        with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use costs
            engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                engine.step()
    for request_id in ids:
        engine.abort(request_id)
    raw = _bucket_events(prof.events())
    total = sum(raw.values())
    buckets = {name: raw[name] / total * step_seconds for name in BUCKETS}
    return StepProfile(batch, step_seconds, buckets)


def _steps_beside(engine: EngineCore, repeats: int, probe: ReadProbe) -> float:
    """The median step, each timed step after a read sample and an untimed step."""
    times = []
    for _ in range(repeats):
        probe.sample()
        engine.step()
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextlib.contextmanager
def without_usdt_lines() -> Iterator[None]:
    """Standard error without the `USDT:... profiler_start` / `profiler_stop` line that torch's
    CPU build writes from C++ each time a profiler starts or stops (a dozen over the tables of
    one run). The lines go to file descriptor 2 directly, so it is caught in a file meanwhile
    and everything else on it is passed on when the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)
            sys.stderr.flush()


def _bucket_events(events: list) -> dict[str, float]:
    """Seconds per bucket, summed over the profiled steps."""
    totals: dict[str, float] = defaultdict(float)

    def scope(event) -> str | None:  # the innermost nanoserve.* scope around an event
        node = event.cpu_parent
        while node is not None:
            if node.name.startswith("nanoserve."):
                return node.name
            node = node.cpu_parent
        return None

    model_ops = layer_ops = 0.0  # operators' own time in the forward, and in its layers
    layer_states = 0.0  # the state update's time inside the layer stack (its native call)
    for event in events:
        if event.name == "nanoserve.step":
            totals["step"] += event.cpu_time_total
        elif event.name.startswith("nanoserve."):
            totals[event.name] += event.cpu_time_total
            if event.name == "nanoserve.delta_rule" and scope(event) == "nanoserve.layers":
                layer_states += event.cpu_time_total
        elif (where := scope(event)) in ("nanoserve.model", "nanoserve.layers"):
            if MATMUL_OPS.search(event.name):
                totals["matmuls"] += event.self_cpu_time_total
            elif ATTENTION_OPS.search(event.name):
                totals["attention"] += event.self_cpu_time_total
            else:
                totals["element-wise"] += event.self_cpu_time_total
            model_ops += event.self_cpu_time_total
            layer_ops += event.self_cpu_time_total if where == "nanoserve.layers" else 0.0
    # the layer stack's time outside any operator and the state update: its one-region path
    # (the dispatcher path's kernels are operators, bucketed above)
    one_region = max(0.0, totals["nanoserve.layers"] - layer_ops - layer_states)
    state_update = totals["nanoserve.delta_rule"]  # one native call, no operator inside
    seconds = {
        "matmuls": totals["matmuls"], "attention": totals["attention"],
        "state update": state_update,
        "element-wise": totals["element-wise"], "one region": one_region,
        "model Python": max(0.0, totals["nanoserve.model"] - model_ops - one_region
                            - state_update),
        "sampler": totals["nanoserve.sample"],
    }
    seconds["engine"] = max(0.0, totals["step"] - sum(seconds.values()))
    return {name: value / 1e6 for name, value in seconds.items()}


def format_profiles(profiles: list[StepProfile]) -> str:
    header = "| bucket | " + " | ".join(f"batch {p.batch}" for p in profiles) + " |"
    lines = [header, "|---|" + "---:|" * len(profiles)]
    for name in BUCKETS:
        if name == "state update" and not any(p.buckets[name] for p in profiles):
            continue  # a model without DeltaNet layers
        cells = [f"{p.buckets[name] * 1e3:.1f} ms ({p.share(name):.0%})" for p in profiles]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{p.step_seconds * 1e3:.1f} ms**"
                                             for p in profiles) + " |")
    return "\n".join(lines)


def run_step_profile(engine: EngineCore, args: argparse.Namespace) -> list[StepProfile]:
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    print(f"decode step, context {args.context_len}, threads={torch.get_num_threads()}, "
          f"CPU kernels: {loaded_tier() or 'none'} (NANOSERVE_CPU_ISA to choose), "
          f"median of {args.repeats}\nkernel schedule: "
          f"{engine.kernel_schedule or 'none'} (--kernel-tuning)\n")
    runner = engine.runner
    assert isinstance(runner, ModelRunner), "a benchmark runs a model (no zero-cost runner)"
    model = runner.model
    probe = ReadProbe(model)  # read rates sampled between the timed steps
    profiles = [profile_decode_step(engine, size, args.context_len, args.repeats, probe)
                for size in sizes]
    print(format_profiles(profiles))
    rates = probe.rates(macs_per_s(model))
    key_cache = engine.runner.kv_caches[0][0]
    print()
    floors = [step_floor(model, key_cache, p.batch, args.context_len, rates) for p in profiles]
    print(format_floors([(p.batch, p.step_seconds, floor)
                         for p, floor in zip(profiles, floors, strict=True)], rates))
    if (peak := measure_peak(model)) is not None:
        print()
        # (a batch the one region runs holds its matmuls there, outside the matmul bucket)
        print(format_peak(peak, [(p.batch, p.buckets["matmuls"], floor.macs)
                                 for p, floor in zip(profiles, floors, strict=True)
                                 if p.buckets["one region"] < p.buckets["matmuls"]]))
    if args.compare_eager:
        print()
        print(format_eager(compare_eager(engine, sizes, args.context_len, args.repeats)))
    if args.compare_compiled:
        print()
        print(format_compiled(compare_compiled(engine, sizes, args.context_len, args.repeats)))
    if args.rows_curve:
        curve = rows_curve(engine, args.context_len, args.rows_curve, args.repeats)
        print()
        print(format_rows_curve(curve, args.context_len))
    return profiles


def rows_curve(engine: EngineCore, context_len: int, max_drafts: int,
               repeats: int) -> list[tuple[int, float]]:
    """(rows, median step seconds) of one decoding request scoring 1 + k rows, k = 0..K."""
    (request_id,) = start_decoding(engine, 1, context_len, (max_drafts + 1) * (repeats + 1) + 2,
                                   "rows")
    (request,) = engine.scheduler.running
    curve = []
    for k in range(max_drafts + 1):
        times = []
        for i in range(repeats + 1):
            request.draft_token_ids = [0] * k  # token 0 is never drawn here: all rejected
            start = time.perf_counter()
            engine.step()
            if i:  # the first is a warm-up for this shape
                times.append(time.perf_counter() - start)
        curve.append((1 + k, statistics.median(times)))
    engine.abort(request_id)
    return curve


def format_rows_curve(curve: list[tuple[int, float]], context_len: int) -> str:
    one_row = curve[0][1]
    lines = [f"one request, context {context_len}: a step scoring 1 + k rows",
             "| rows | step | vs 1 row |", "|---:|---:|---:|"]
    lines += [f"| {rows} | {seconds * 1e3:.1f} ms | {seconds / one_row:.2f}x |"
              for rows, seconds in curve]
    return "\n".join(lines)

"""`bench step --compare-eager`: the decoder layers as one native call against the Python
layer loop (`--enforce-eager`), on one engine, toggled between rounds so that both see the
same machine load (model/native_layers.py: the same kernels, the same arithmetic)."""

from __future__ import annotations

import statistics

from nanoserve.bench.roofline import start_decoding
from nanoserve.bench.timing import median_seconds
from nanoserve.engine.core import EngineCore


def compare_eager(engine: EngineCore, batch_sizes: list[int], context_len: int,
                  repeats: int, rounds: int = 6) -> list[tuple[int, float, float]]:
    """(batch, native step seconds, eager step seconds): medians over interleaved rounds of
    `repeats` steps each."""
    plan = engine.runner.plan  # the runner's choice of the layers' path
    figures = []
    for batch in batch_sizes:
        ids = start_decoding(engine, batch, context_len, 2 * rounds * (repeats + 1) + 2, "eager")
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for native in (True, False):
                plan.use_native_layers = native
                times[native].append(median_seconds(engine.step, repeats))
        plan.use_native_layers = not engine.config.model.enforce_eager
        for request_id in ids:
            engine.abort(request_id)
        figures.append((batch, statistics.median(times[True]), statistics.median(times[False])))
    return figures


def format_eager(figures: list[tuple[int, float, float]], rounds: int = 6) -> str:
    lines = [f"decoder layers: one native call vs the Python loop (--enforce-eager), medians "
             f"of {rounds} interleaved rounds",
             "| batch | native | eager | eager / native |", "|---:|---:|---:|---:|"]
    lines += [f"| {batch} | {native * 1e3:.2f} ms | {eager * 1e3:.2f} ms | "
              f"{eager / native:.2f}x |" for batch, native, eager in figures]
    return "\n".join(lines)

"""Timing helpers for the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def call_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall times of `repeats` calls of `fn`, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls of `fn`, after one warm-up call."""
    return statistics.median(call_times(fn, repeats))


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of `repeats` calls of `fn`, after one warm-up call."""
    return min(call_times(fn, repeats))

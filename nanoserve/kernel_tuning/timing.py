"""Timing candidates against each other so that a noisy neighbour cannot crown a loser.

Every round runs each candidate once, in a fresh random order, so a burst of load on the
machine falls on a few candidates of one round rather than on all rounds of one candidate; a
candidate's score is its median over the rounds. The default wins ties: another candidate is
chosen only when its median is at least `MIN_GAIN` below the default's, so a choice is never a
measurement's noise (and an unchanged default costs nothing to keep).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

Candidate = TypeVar("Candidate")

MIN_GAIN = 0.03  # 3 %: below it the default stays


@dataclass(frozen=True)
class Timed(Generic[Candidate]):
    """One candidate's median time over the rounds."""

    candidate: Candidate
    seconds: float


def time_interleaved(candidates: Sequence[Candidate], run: Callable[[Candidate], None],
                     rounds: int, seed: int = 0) -> list[Timed[Candidate]]:
    """Each candidate's median seconds of `run(candidate)` over `rounds` interleaved rounds
    (after one untimed round, which faults pages in and warms the code)."""
    samples = time_rounds(candidates, run, rounds, seed)
    return [Timed(c, statistics.median(s)) for c, s in zip(candidates, samples, strict=True)]


def time_rounds(candidates: Sequence[Candidate], run: Callable[[Candidate], None],
                rounds: int, seed: int = 0) -> list[list[float]]:
    """`time_interleaved`'s samples: per candidate, its seconds in each round, in round order
    (so that two candidates' samples of one round, taken moments apart, can be paired)."""
    order = list(range(len(candidates)))
    shuffler = random.Random(seed)
    for i in order:
        run(candidates[i])
    samples: list[list[float]] = [[] for _ in candidates]
    for _ in range(rounds):
        shuffler.shuffle(order)
        for i in order:
            started = time.perf_counter()
            run(candidates[i])
            samples[i].append(time.perf_counter() - started)
    return samples


def choose(timed: Sequence[Timed[Candidate]], default: Candidate) -> Candidate:
    """The fastest candidate, or `default` unless the fastest beats it by MIN_GAIN."""
    best = min(timed, key=lambda t: t.seconds)
    baseline = next((t for t in timed if t.candidate == default), None)
    if baseline is None or best.seconds < baseline.seconds * (1 - MIN_GAIN):
        return best.candidate
    return default


def best_threshold(candidates: Sequence[int], above: dict[int, float],
                   below: dict[int, float], default: int) -> int:
    """The threshold t (one of `candidates`) for a choice between two kernels, the `above`
    one from t rows on: the one whose kernels, at the measured row counts (`above[rows]`,
    `below[rows]`: each kernel's seconds there), sum the least time, each count weighed
    alike (as a ratio to its faster kernel). `default` unless another sums MIN_GAIN less."""
    def cost(threshold: int) -> float:
        return sum((above[rows] if rows >= threshold else below[rows])
                   / min(above[rows], below[rows]) for rows in above)

    best = min(candidates, key=cost)
    return best if cost(best) < cost(default) * (1 - MIN_GAIN) else default

"""`bench route`'s data: the workload, a trace entry and a result. Both the trace and flags
(`route.py`) and the simulation (`route_sim.py`) read them, so they sit below both."""

from __future__ import annotations

from dataclasses import dataclass

VOCAB = 32000
TraceEntry = tuple[float, list[int], int]  # arrival step, prompt ids, output tokens


@dataclass(frozen=True)
class Workload:
    """The trace and the simulated engines; `arrival_rate` is requests per engine step."""

    num_groups: int = 16
    prompts_per_group: int = 16
    prefix_len: int = 256
    suffix_len: int = 64
    output_len: int = 64
    arrival_rate: float = 0.5
    num_blocks: int = 512  # per engine
    block_size: int = 16
    max_num_seqs: int = 64
    prefill_chunk: int = 512  # prompt tokens an engine prefills per step
    seed: int = 0


@dataclass(frozen=True)
class RouteResult:
    policy: str
    num_replicas: int
    hit_rate: float
    max_over_mean: float  # requests per engine: 1.0 is an even spread
    mean_wait: float  # steps from arrival to admission
    p90_wait: float
    num_overrides: int  # requests sent to the least loaded engine against their prefix

"""`nanoserve bench route`: cache-aware against round-robin routing over N replicas, by
simulation on a shared-prefix trace (issue 23 item 5; the real-server DP test comes later).

The trace is llm-d's `shared_prefix` workload scaled down: G groups of P prompts, each a
group's long system prompt plus a unique suffix, arriving interleaved at random (seeded),
Poisson in time. Each simulated engine is the real `KVCacheManager` (its prefix cache,
eviction order and counters) with a fixed number of blocks and a `max_num_seqs`; no model
runs. An admitted request holds its blocks for the steps its uncached prefill and its decode
would take (one prefill chunk a step, one token a step), then frees them, as the scheduler
does at finish. Requests wait in arrival order when an engine is full. Routing is
`engine/dp_router.py`, the policy the API side will use, over the engines' in-flight counts.

A trace can be saved (`--save-trace`) and replayed (`--trace`): JSON lines of `arrival` (in
engine steps), `prompt_token_ids` and `output_len`, so a recorded workload of that shape runs
the same way. The trace, the flags and the table are here; the simulation is `route_sim.py`
(it loads the engine's modules, which `nanoserve --help` must not).

Printed per policy and replica count: the prefix-cache hit rate (cached prompt tokens /
prompt tokens, the scheduler's meaning), the same against one replica, the load balance (max
/ mean requests per engine), the wait for admission in steps, and how many requests the
load-balance override sent away from their prefix. It measures where prefixes land, not
speed: engines here cost nothing to run.
"""

from __future__ import annotations

import argparse
import json
import random

from nanoserve.bench.route_data import VOCAB, RouteResult, TraceEntry, Workload


def shared_prefix_trace(w: Workload) -> list[TraceEntry]:
    """The trace in arrival order: groups interleaved at random."""
    rng = random.Random(w.seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(w.prefix_len)]
                for _ in range(w.num_groups)]
    prompts = [prefix + [rng.randrange(VOCAB) for _ in range(w.suffix_len)]
               for prefix in prefixes for _ in range(w.prompts_per_group)]
    rng.shuffle(prompts)
    trace: list[TraceEntry] = []
    now = 0.0
    for prompt in prompts:
        now += rng.expovariate(w.arrival_rate)
        trace.append((now, prompt, w.output_len))
    return trace


def write_trace(path: str, trace: list[TraceEntry]) -> None:
    with open(path, "w") as f:
        for arrival, prompt, output_len in trace:
            f.write(json.dumps({"arrival": arrival, "prompt_token_ids": prompt,
                                "output_len": output_len}) + "\n")


def read_trace(path: str) -> list[TraceEntry]:
    """A saved or recorded trace, sorted by arrival."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted(((float(r["arrival"]), list(r["prompt_token_ids"]), int(r["output_len"]))
                   for r in rows), key=lambda entry: entry[0])


def format_results(results: list[RouteResult]) -> str:
    """The table `bench route` prints; hit rates also as a share of one replica's."""
    single = {r.policy: r.hit_rate for r in results if r.num_replicas == 1}
    lines = [f"{'policy':<12} {'replicas':>8} {'hit rate':>9} {'vs 1 replica':>13} "
             f"{'max/mean reqs':>14} {'wait mean':>10} {'wait p90':>9} {'overrides':>10}"]
    for r in results:
        base = single.get(r.policy)
        vs = f"{r.hit_rate / base:.0%}" if base else "-"
        lines.append(f"{r.policy:<12} {r.num_replicas:>8} {r.hit_rate:>9.1%} {vs:>13} "
                     f"{r.max_over_mean:>14.2f} {r.mean_wait:>10.1f} {r.p90_wait:>9.1f} "
                     f"{r.num_overrides:>10}")
    return "\n".join(lines)


def add_route_args(p: argparse.ArgumentParser) -> None:
    d = Workload()
    p.add_argument("--groups", type=int, default=d.num_groups, help="system prompts (%(default)s)")
    p.add_argument("--prompts-per-group", type=int, default=d.prompts_per_group)
    p.add_argument("--prefix-len", type=int, default=d.prefix_len,
                   help="tokens of each group's shared prefix (default: %(default)s)")
    p.add_argument("--suffix-len", type=int, default=d.suffix_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--arrival-rate", type=float, default=d.arrival_rate,
                   help="requests per engine step, Poisson (default: %(default)s)")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks,
                   help="KV blocks per engine (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--replicas", default="1,2,4,8", help="comma-separated (%(default)s)")
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay this trace (JSON lines) instead of generating one")
    p.add_argument("--save-trace", default=None, metavar="FILE",
                   help="write the trace replayed, as JSON lines")


def run_route_bench(args: argparse.Namespace) -> int:
    w = Workload(num_groups=args.groups, prompts_per_group=args.prompts_per_group,
                 prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                 output_len=args.output_len, arrival_rate=args.arrival_rate,
                 num_blocks=args.num_blocks, block_size=args.block_size,
                 max_num_seqs=args.max_num_seqs, seed=args.seed)
    from nanoserve.bench.route_sim import simulate  # the engine's modules: not for --help

    trace = read_trace(args.trace) if args.trace else shared_prefix_trace(w)
    if args.save_trace:
        write_trace(args.save_trace, trace)
    results = [simulate(w, policy, int(n), trace) for policy in args.policies.split(",")
               for n in args.replicas.split(",")]
    shape = (f"{len(trace)} requests from {args.trace}" if args.trace else
             f"{w.num_groups} groups x {w.prompts_per_group} prompts, {w.prefix_len}-token "
             f"prefix + {w.suffix_len} unique, {w.output_len} out; {w.arrival_rate} "
             "arrivals/step")
    print(f"{shape}; {w.num_blocks} blocks of {w.block_size} per engine, max_num_seqs "
          f"{w.max_num_seqs}\n")
    print(format_results(results))
    return 0

"""`nanoserve bench spec`: speculative decoding off and on, the same requests, the same run.

Each round starts one `nanoserve serve` per method (`off`, then each `--speculative-config`
method), in turns, and sends every workload (`spec_workloads.py`): the copying ones at
`--copy-concurrency` (one stream by default), open chat at each of `--chat-concurrency`.
Requests are chat completions, streamed, with natural EOS (loops would inflate acceptance);
each alternates greedy and seeded (`temperature 0.7, top_p 0.9`, a seed per request), so with
outputs identical on and off the tok/s compare the same streams. The figures are medians over
`--rounds`; the table shows each method's ratio against `off`, and whether every text equalled
off's. Acceptance comes from the server's `nanoserve:spec_decode_*` counters where exported.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from nanoserve.bench.load_client import make_client, run_level, summarize
from nanoserve.bench.spec_workloads import COPY_WORKLOADS, workload_prompts
from nanoserve.config import DEFAULT_MODEL_NAME

_CHAT = "/v1/chat/completions"
_COUNTERS = ("nanoserve:spec_decode_num_drafts", "nanoserve:spec_decode_num_draft_tokens",
             "nanoserve:spec_decode_num_accepted_tokens")


@dataclass
class Cell:
    """One (method, workload, concurrency): the figures of each round."""

    tokens_per_s: list[float] = field(default_factory=list)
    itl_p50: list[float] = field(default_factory=list)
    itl_p99: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the first round's, in request order
    accepted_per_draft: float | None = None
    failures: int = 0


def request_bodies(model: str, workload: str, count: int, max_tokens: int) -> list[dict[str, Any]]:
    bodies = []
    for i, prompt in enumerate(workload_prompts(workload, count)):
        sampling: dict[str, Any] = {"temperature": 0.0} if i % 2 == 0 else {
            "temperature": 0.7, "top_p": 0.9, "seed": 1000 + i}
        bodies.append({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}, **sampling})
    return bodies


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in _COUNTERS:
            if line.startswith(name + "_total") or line.startswith(name + "{") \
                    or line.startswith(name + " "):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


async def run_workloads(url: str, plan: Sequence[tuple[str, int]], args: argparse.Namespace,
                        cells: dict[tuple[str, int], Cell]) -> None:
    async with make_client(max(level for _, level in plan)) as client:
        for workload, level in plan:
            count = max(level, args.requests_per_level)
            bodies = request_bodies(args.model_name, workload, count, args.max_tokens)
            before = counters(url)
            records = await run_level(client, url, bodies, level, {}, path=_CHAT)
            after = counters(url)
            stats = summarize(records, level)
            cell = cells.setdefault((workload, level), Cell())
            cell.tokens_per_s.append(stats.tokens_per_s)
            cell.itl_p50.append(stats.itl[0] * 1e3)
            cell.itl_p99.append(stats.itl[2] * 1e3)
            cell.failures += stats.failures
            if not cell.texts:
                cell.texts = [r.text for r in records]
            drafts = after.get(_COUNTERS[0], 0.0) - before.get(_COUNTERS[0], 0.0)
            if drafts:
                accepted = after[_COUNTERS[2]] - before.get(_COUNTERS[2], 0.0)
                cell.accepted_per_draft = accepted / drafts
            print(f"  {workload} at {level}: {stats.tokens_per_s:.1f} tok/s", file=sys.stderr)


def run_spec_bench(args: argparse.Namespace) -> int:
    from nanoserve.bench.serve import nanoserve_server

    methods = ["off", *[m for m in args.methods.split(",") if m and m != "off"]]
    plan = [(w, level) for w in COPY_WORKLOADS for level in _levels(args.copy_concurrency)]
    plan += [("chat", level) for level in _levels(args.chat_concurrency)]
    args.model_name = args.model or DEFAULT_MODEL_NAME
    results: dict[str, dict[tuple[str, int], Cell]] = {m: {} for m in methods}
    for round_index in range(args.rounds):
        for method in methods:
            extra = list(args.server_args.split())
            if method != "off":
                extra += ["--speculative-config", _config_json(method, args)]
            print(f"round {round_index + 1}: {method}", file=sys.stderr)
            with nanoserve_server(args.model, extra) as (url, _):
                if args.model is None:
                    args.model_name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                asyncio.run(run_workloads(url, plan, args, results[method]))
    for line in format_report(results, methods, plan, args):
        print(line)
    return 1 if any(c.failures for cells in results.values() for c in cells.values()) else 0


def format_report(results: dict[str, dict[tuple[str, int], Cell]], methods: Sequence[str],
                  plan: Sequence[tuple[str, int]], args: argparse.Namespace) -> list[str]:
    lines = [f"chat completions, streamed, natural EOS, max_tokens {args.max_tokens}, half "
             f"greedy and half seeded; medians of {args.rounds} interleaved rounds; "
             f"{args.num_speculative_tokens} draft tokens",
             f"{'workload':<9} {'conc':>4} {'method':<7} {'tok/s':>7} {'vs off':>7} "
             f"{'ITL p50':>8} {'p99':>7} {'acc/draft':>9} {'same text':>9}"]
    for workload, level in plan:
        base = results["off"][(workload, level)]
        for method in methods:
            cell = results[method][(workload, level)]
            speed = statistics.median(cell.tokens_per_s)
            ratio = speed / statistics.median(base.tokens_per_s)
            accepted = "-" if cell.accepted_per_draft is None else f"{cell.accepted_per_draft:.2f}"
            same = "-" if method == "off" else ("yes" if cell.texts == base.texts else "NO")
            lines.append(f"{workload:<9} {level:>4} {method:<7} {speed:>7.1f} {ratio:>6.2f}x "
                         f"{statistics.median(cell.itl_p50):>8.1f} "
                         f"{statistics.median(cell.itl_p99):>7.1f} {accepted:>9} {same:>9}")
    return lines


def _config_json(method: str, args: argparse.Namespace) -> str:
    return (f'{{"method": "{method}", "num_speculative_tokens": '
            f'{args.num_speculative_tokens}}}')


def _levels(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model to serve (default: the default)")
    p.add_argument("--methods", default="off,ngram,suffix",
                   help="speculative methods to compare against off (default: %(default)s)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--copy-concurrency", default="1",
                   help="streams for the copying workloads (default: %(default)s)")
    p.add_argument("--chat-concurrency", default="1,8,32",
                   help="streams for open chat (default: %(default)s)")
    p.add_argument("--requests-per-level", type=int, default=2,
                   help="at least this many requests per workload and level")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-args", default="",
                   help="extra flags for every server, one string")

"""`nanoserve bench spec`: speculative decoding off and on, the same requests, the same run,
beside llama.cpp's `llama-server` with its own n-gram speculation on the same GGUF file.

Each round starts one `nanoserve serve` per method (`off`, then each `--speculative-config`
method), then one llama-server per `--peer-spec-types` configuration and level (spec_peer.py),
in turns, and sends every workload (`spec_workloads.py`): the copying ones at
`--copy-concurrency` (one stream by default), open chat at each of `--chat-concurrency`.
Requests are chat completions, streamed, with natural EOS (loops would inflate acceptance);
each alternates greedy and seeded (`temperature 0.7, top_p 0.9`, a seed per request), so with
outputs identical on and off the tok/s compare the same streams. The figures are medians over
`--rounds`; the table shows each server's ratio against nanoserve `off`, each nanoserve
method's against the fastest llama-server configuration of the row, and whether every text
equalled off's. Acceptance comes from nanoserve's `nanoserve:spec_decode_*` counters and from
the `timings` llama-server sends. Every request-step commits one token of the model's own
plus its accepted drafts, so a cell's request-steps are its output tokens less the accepted
ones; from that come `tok/step` (output tokens per request-step: what a free verify would
speed up by, the ceiling of `vs off` for the outputs the model gave), `drafted` (the share
of request-steps that drafted; llama-server does not say how many steps drafted), `rows/step`
(1 + draft tokens per request-step) and `step cost` (a request-step's time against off's:
tok/step over the speed-up, what verifying the drafts costs; on a hybrid it includes keeping
the DeltaNet state after each draft row, engine/draft_states.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from nanoserve.bench.load_client import make_session, ratio, run_level, summarize
from nanoserve.bench.spec_peer import (
    PEER_PREFIX,
    Drafts,
    add_peer_args,
    peer_label,
    peer_server,
    peer_spec_types,
    timings_drafts,
)
from nanoserve.bench.spec_workloads import COPY_WORKLOADS, workload_prompts
from nanoserve.config import DEFAULT_MODEL_NAME

_CHAT = "/v1/chat/completions"
_COUNTERS = ("nanoserve:spec_decode_num_drafts", "nanoserve:spec_decode_num_draft_tokens",
             "nanoserve:spec_decode_num_accepted_tokens")
TARGET_VS_PEER = 1.5  # the bar: copying at one stream vs llama-server at its best

Plan = Sequence[tuple[str, int]]  # (workload, concurrency) in the order they run


@dataclass
class Cell:
    """One (server, workload, concurrency): the figures of each round."""

    tokens_per_s: list[float] = field(default_factory=list)
    itl_p50: list[float] = field(default_factory=list)
    itl_p99: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the first round's, in request order
    drafts: Drafts | None = None  # summed over the rounds
    output_tokens: int = 0  # summed over the rounds
    failures: int = 0

    @property
    def request_steps(self) -> float | None:
        """Request-steps the outputs took: each commits one token plus its accepted drafts."""
        if self.drafts is None or not self.output_tokens:
            return None
        return self.output_tokens - self.drafts.num_accepted

    @property
    def tokens_per_step(self) -> float | None:
        steps = self.request_steps
        return self.output_tokens / steps if steps else None

    @property
    def drafted_share(self) -> float | None:
        steps = self.request_steps
        if not steps or self.drafts is None or self.drafts.num_drafts is None:
            return None
        return self.drafts.num_drafts / steps

    @property
    def rows_per_step(self) -> float | None:
        """Rows a request-step computes: its one token plus the drafts it verifies."""
        steps = self.request_steps
        if not steps or self.drafts is None:
            return None
        return 1.0 + self.drafts.num_draft_tokens / steps

    def step_cost(self, off: Cell) -> float | None:
        """A request-step's time against `off`'s one-row step (the verify's price): its
        tok/step over its speed-up."""
        per_step = self.tokens_per_step
        if per_step is None or not self.tokens_per_s or not off.tokens_per_s or not off.speed:
            return None
        return per_step / (self.speed / off.speed)

    @property
    def speed(self) -> float:
        return statistics.median(self.tokens_per_s)


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


def counter_drafts(before: dict[str, float], after: dict[str, float]) -> Drafts:
    """nanoserve's draft counters over one level."""
    drafts, tokens, accepted = (after.get(n, 0.0) - before.get(n, 0.0) for n in _COUNTERS)
    return Drafts(drafts, tokens, accepted)


async def run_workloads(url: str, plan: Plan, args: argparse.Namespace,
                        cells: dict[tuple[str, int], Cell], is_peer: bool = False) -> None:
    """Every (workload, level) of `plan` against one server, into `cells`."""
    async with make_session(max(level for _, level in plan)) as session:
        # one untimed request first: a fresh server's first one pays for loading and warming
        warm_up = request_bodies(args.model_name, "chat", 1, 16)
        await run_level(session, url, warm_up, 1, {}, path=_CHAT)
        for workload, level in plan:
            count = max(level, args.requests_per_level)
            bodies = request_bodies(args.model_name, workload, count, args.max_tokens)
            before = {} if is_peer else counters(url)
            records = await run_level(session, url, bodies, level, {}, path=_CHAT,
                                      keep_bodies=is_peer)
            drafts = timings_drafts([r.body or b"" for r in records]) if is_peer \
                else counter_drafts(before, counters(url))
            stats = summarize(records, level)
            cell = cells.setdefault((workload, level), Cell())
            cell.tokens_per_s.append(stats.tokens_per_s)
            cell.itl_p50.append(stats.itl[0] * 1e3)
            cell.itl_p99.append(stats.itl[2] * 1e3)
            cell.failures += stats.failures
            cell.output_tokens += stats.output_tokens
            cell.drafts = drafts if cell.drafts is None else cell.drafts + drafts
            if not cell.texts:
                cell.texts = [r.text for r in records]
            print(f"  {workload} at {level}: {stats.tokens_per_s:.1f} tok/s", file=sys.stderr)


def run_spec_bench(args: argparse.Namespace) -> int:
    """Interleaved rounds of every server; print the report.

    Exit status 1 if any request failed, 2 if a server could not be built or started, else 0.
    """
    methods = ["off", *[m for m in args.methods.split(",") if m and m != "off"]]
    peers = peer_spec_types(args)
    plan = [(w, level) for w in COPY_WORKLOADS for level in _levels(args.copy_concurrency)]
    plan += [("chat", level) for level in _levels(args.chat_concurrency)]
    args.model_name = args.model or DEFAULT_MODEL_NAME
    servers = methods + [peer_label(t) for t in peers]
    results: dict[str, dict[tuple[str, int], Cell]] = {s: {} for s in servers}
    peer_settings: set[str] = set()
    try:
        peer_files = _peer_files(args.model) if peers else None
        for round_index in range(args.rounds):
            for method in methods:
                print(f"round {round_index + 1}: {method}", file=sys.stderr)
                _run_nanoserve(method, plan, args, results[method])
            for spec_type in peers:
                assert peer_files is not None
                print(f"round {round_index + 1}: {peer_label(spec_type)}", file=sys.stderr)
                _run_peer(peer_files, spec_type, plan, args, results[peer_label(spec_type)],
                          peer_settings)
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"nanoserve bench spec: error: {e}", file=sys.stderr)
        return 2
    for line in format_report(results, servers, plan, args):
        print(line)
    if peer_settings:
        print(f"llama-server ran in its {', '.join(sorted(peer_settings))} setting "
              f"(--no-repack where its default one exited at start)")
    return 1 if any(c.failures for cells in results.values() for c in cells.values()) else 0


def _run_nanoserve(method: str, plan: Plan, args: argparse.Namespace,
                   cells: dict[tuple[str, int], Cell]) -> None:
    from nanoserve.bench.serve import nanoserve_server

    extra = list(args.server_args.split())
    if method != "off":
        extra += ["--speculative-config", _config_json(method, args)]
    with nanoserve_server(args.model, extra) as (url, _):
        if args.model is None:
            args.model_name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(run_workloads(url, plan, args, cells))


def _run_peer(files: tuple[Path, Path], spec_type: str, plan: Plan, args: argparse.Namespace,
              cells: dict[tuple[str, int], Cell], settings: set[str]) -> None:
    """One llama-server configuration: a server per level, with a slot per stream; the
    settings it ran in go into `settings`."""
    binary, gguf = files
    for level in dict.fromkeys(level for _, level in plan):
        with peer_server(binary, gguf, spec_type, level, args) as (url, setting):
            part = [(w, lv) for w, lv in plan if lv == level]
            asyncio.run(run_workloads(url, part, args, cells, is_peer=True))
            settings.add(setting)


def _peer_files(model: str | None) -> tuple[Path, Path]:
    """llama-server (built on first use) and the GGUF file both servers serve."""
    from nanoserve.bench.llama_server import ensure_llama_server
    from nanoserve.bench.serve import gguf_for_llama_server

    gguf = gguf_for_llama_server(model)  # first: a model that is no GGUF fails before a build
    return ensure_llama_server(), gguf


def best_peer(results: dict[str, dict[tuple[str, int], Cell]], servers: Sequence[str],
              key: tuple[str, int]) -> tuple[str, float] | None:
    """The fastest llama-server configuration on one row (`none` included: llama-server at
    its best) and its median tok/s; None without a peer."""
    speeds = [(s, results[s][key].speed) for s in servers if s.startswith(PEER_PREFIX)]
    return max(speeds, key=lambda pair: pair[1]) if speeds else None


def format_report(results: dict[str, dict[tuple[str, int], Cell]], servers: Sequence[str],
                  plan: Plan, args: argparse.Namespace) -> list[str]:
    """The table, a row per (workload, level, server), then the copying rows against the
    fastest llama-server configuration."""
    width = max(7, *(len(s) for s in servers))
    lines = [f"chat completions, streamed, natural EOS, max_tokens {args.max_tokens}, half "
             f"greedy and half seeded; medians of {args.rounds} interleaved rounds; "
             f"{args.num_speculative_tokens} draft tokens",
             "vs llama: against the fastest llama-server configuration of the row; acc/tok: "
             "accepted per draft token; acc len: 1 + accepted / drafting steps; tok/step: "
             "output tokens per request-step (the most a free verify gives); drafted: share "
             "of request-steps that drafted; rows/step: rows a request-step computes (1 + its "
             "drafts); step cost: a request-step's time against off's (the verify's price)",
             f"{'workload':<9} {'conc':>4} {'server':<{width}} {'tok/s':>7} {'vs off':>7} "
             f"{'vs llama':>8} {'ITL p50':>8} {'p99':>7} {'acc/tok':>7} {'acc len':>7} "
             f"{'tok/step':>8} {'drafted':>7} {'rows/step':>9} {'step cost':>9} "
             f"{'same text':>9}"]
    for key in plan:
        base = results["off"][key]
        best = best_peer(results, servers, key)
        for server in servers:
            cell = results[server][key]
            kept, length = (None, None) if cell.drafts is None else (
                cell.drafts.accepted_per_draft_token, cell.drafts.mean_accepted_length)
            is_peer = server.startswith(PEER_PREFIX)
            if best is None or (is_peer and server != best[0]):
                vs_peer = "-"
            else:
                vs_peer = "best" if is_peer else f"{ratio(cell.speed, best[1]):.2f}x"
            same = "-" if server == "off" or is_peer else (
                "yes" if cell.texts == base.texts else "NO")
            lines.append(f"{key[0]:<9} {key[1]:>4} {server:<{width}} {cell.speed:>7.1f} "
                         f"{ratio(cell.speed, base.speed):>6.2f}x {vs_peer:>8} "
                         f"{statistics.median(cell.itl_p50):>8.1f} "
                         f"{statistics.median(cell.itl_p99):>7.1f} "
                         f"{_figure(kept):>7} {_figure(length):>7} "
                         f"{_figure(cell.tokens_per_step):>8} "
                         f"{_figure(cell.drafted_share):>7} {_figure(cell.rows_per_step):>9} "
                         f"{_figure(cell.step_cost(base)):>9} {same:>9}")
    return lines + target_lines(results, servers, plan)


def target_lines(results: dict[str, dict[tuple[str, int], Cell]], servers: Sequence[str],
                 plan: Plan) -> list[str]:
    """Each nanoserve method on the copying workloads at one stream against the fastest
    llama-server configuration there, and the lowest of those ratios."""
    keys = [key for key in plan if key[0] in COPY_WORKLOADS and key[1] == 1]
    bests = {key: best_peer(results, servers, key) for key in keys}
    if not keys or any(best is None for best in bests.values()):
        return []
    lines = [f"copying at one stream vs the fastest llama-server configuration "
             f"(target >= {TARGET_VS_PEER:.2f}x):"]
    for server in servers:
        if server.startswith(PEER_PREFIX):
            continue
        ratios = {key: ratio(results[server][key].speed, best[1])
                  for key, best in bests.items() if best is not None}
        figures = "  ".join(f"{key[0]} {r:.2f}x" for key, r in ratios.items())
        lowest = min(ratios.values())
        verdict = "meets" if lowest >= TARGET_VS_PEER else "below"
        lines.append(f"  {server:<8} {figures}  lowest {lowest:.2f}x ({verdict})")
    return lines


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _config_json(method: str, args: argparse.Namespace) -> str:
    return (f'{{"method": "{method}", "num_speculative_tokens": '
            f'{args.num_speculative_tokens}}}')


def _levels(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model to serve (default: the default)")
    p.add_argument("--methods", default="off,ngram,suffix",
                   help="speculative methods to compare against off (default: %(default)s); "
                   "mtp runs the model's own MTP head (a checkpoint with mtp.* weights: on "
                   "random weights it drafts noise, its acceptance ~0)")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="draft tokens per step, nanoserve's and llama-server's")
    p.add_argument("--copy-concurrency", default="1",
                   help="streams for the copying workloads (default: %(default)s)")
    p.add_argument("--chat-concurrency", default="1,8,32",
                   help="streams for open chat (default: %(default)s)")
    p.add_argument("--requests-per-level", type=int, default=2,
                   help="at least this many requests per workload and level")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--server-args", default="",
                   help="extra flags for every nanoserve server, one string")
    add_peer_args(p)

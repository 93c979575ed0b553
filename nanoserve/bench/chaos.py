"""`nanoserve bench chaos`: many clients misbehaving at once, then a check that nothing leaked.

`--num-requests` requests run with at most `--concurrency` in flight, each given one behaviour
by a seeded draw:
- disconnect (`--disconnect-share`): a stream closed after a random 1-8 chunks;
- timeout (`--timeout-share`): a non-streamed request whose client gives up after a random
  0.2-2 s, long before its answer;
- slow reader (`--slow-share`): a stream that stops reading for a random 1-4 s after its first
  chunk, then reads to the end (it must still get its whole answer, and not slow the others);
- finish (the rest): streamed or not, in turns, read at once.
All are greedy with EOS ignored, so a finished answer has one right text: each finished
request is sent again afterwards, undisturbed (same concurrency, no misbehaving neighbours),
to the same route, and the two texts must be equal. The requests go, in turns, to each route
of `--endpoints` (completions, chat completions, Anthropic's messages, OpenAI's responses:
`chaos_endpoints.py`).

Before the run a warm-up round of the same shape (so that start-up allocations are not counted
as growth) and after it, once the server is idle: requests running and waiting, KV blocks in
use (`/metrics`), and, when the benchmark started the server itself, the resident memory of
the server's processes against before.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from nanoserve.bench.chaos_endpoints import path, read_answer, read_event, request_body
from nanoserve.bench.load_client import make_prompts, make_session, served_model_name, sse_data
from nanoserve.config import DEFAULT_MODEL_NAME

BEHAVIOURS = ("disconnect", "timeout", "slow", "finish")
IDLE_TIMEOUT_S = 120.0


@dataclass
class Outcome:
    """What one client saw."""

    behaviour: str
    streamed: bool
    prompt: str
    endpoint: str = "completions"
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    completed: bool = False  # the whole answer arrived (data: [DONE], or the JSON body)


@dataclass
class ServerState:
    running: float
    waiting: float
    kv_blocks_in_use: float
    rss_bytes: int | None  # the server's processes together; None when not ours to read

    def line(self) -> str:
        rss = "n/a" if self.rss_bytes is None else f"{self.rss_bytes / 2**20:.1f} MiB"
        return (f"running {self.running:.0f}, waiting {self.waiting:.0f}, "
                f"KV blocks in use {self.kv_blocks_in_use:.0f}, resident memory {rss}")


def plan(num_requests: int, args: argparse.Namespace) -> list[str]:
    """Each request's behaviour: the shares rounded to counts, in a seeded shuffled order."""
    counts = {"disconnect": round(num_requests * args.disconnect_share),
              "timeout": round(num_requests * args.timeout_share),
              "slow": round(num_requests * args.slow_share)}
    if sum(counts.values()) > num_requests:
        raise ValueError("the shares add up to more than every request")
    behaviours = [name for name, count in counts.items() for _ in range(count)]
    behaviours += ["finish"] * (num_requests - len(behaviours))
    random.Random(args.seed).shuffle(behaviours)
    return behaviours


# -- one client ---------------------------------------------------------------------------------
def make_client(max_concurrency: int) -> httpx.AsyncClient:
    """httpx, for its per-request timeouts (the timing benchmarks use aiohttp, which costs the
    machine less CPU; here nothing is timed)."""
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0),
                             limits=httpx.Limits(max_connections=max_concurrency + 4,
                                                 max_keepalive_connections=max_concurrency + 4))


async def run_client(client: httpx.AsyncClient, url: str, endpoint: str, body: dict[str, Any],
                     behaviour: str, rng: random.Random, headers: dict[str, str]) -> Outcome:
    """One request with its behaviour; never raises (what went wrong is in the outcome)."""
    streamed = behaviour in ("disconnect", "slow") or (behaviour == "finish"
                                                       and rng.random() < 0.5)
    out = Outcome(behaviour, streamed, body.get("prompt") or body.get("input")
                  or body["messages"][0]["content"], endpoint)
    target = url.rstrip("/") + path(endpoint)
    try:
        if not streamed:
            timeout = rng.uniform(0.2, 2.0) if behaviour == "timeout" else None
            response = await client.post(target, json=body, headers=headers,
                                         timeout=timeout or client.timeout)
            data = response.json()
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {data}"
            else:
                answer = read_answer(endpoint, data)
                out.text, out.finish_reason, out.completed = answer.text, \
                    answer.finish_reason, True
            return out
        stop_after = rng.randint(1, 8) if behaviour == "disconnect" else None
        pause = rng.uniform(1.0, 4.0) if behaviour == "slow" else None
        async with client.stream("POST", target, json={**body, "stream": True},
                                 headers=headers) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}"
                return out
            chunks = 0
            async for line in response.aiter_lines():
                payload = sse_data(line)
                if payload is None:
                    continue
                if payload == "[DONE]":
                    out.completed = True
                    break
                piece = read_event(endpoint, json.loads(payload))
                if piece.error is not None:
                    out.error = piece.error
                    break
                out.text += piece.text
                out.finish_reason = piece.finish_reason or out.finish_reason
                if piece.is_done:
                    out.completed = True
                    break
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    break  # leaving the block closes the connection mid-stream
                if pause is not None and chunks == 1:
                    await asyncio.sleep(pause)  # nothing is read meanwhile
    except httpx.TimeoutException:
        out.error = "client timeout"
    except Exception as e:  # one request's failure is a figure, not a crash
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_clients(url: str, model: str, prompts: Sequence[str], behaviours: Sequence[str],
                      args: argparse.Namespace, headers: dict[str, str],
                      endpoints: Sequence[str] | None = None) -> list[Outcome]:
    """Each prompt as one client; the i-th goes to `endpoints[i]` (by default the routes of
    --endpoints in turns)."""
    semaphore = asyncio.Semaphore(args.concurrency)
    rngs = [random.Random(args.seed * 7919 + i) for i in range(len(prompts))]
    routes = args_endpoints(args)
    chosen = list(endpoints) if endpoints is not None else [
        routes[i % len(routes)] for i in range(len(prompts))]

    async with make_client(args.concurrency) as client:
        async def limited(i: int) -> Outcome:
            body = request_body(chosen[i], model, prompts[i], args.output_len)
            async with semaphore:
                return await run_client(client, url, chosen[i], body, behaviours[i], rngs[i],
                                        headers)

        return list(await asyncio.gather(*(limited(i) for i in range(len(prompts)))))


def args_endpoints(args: argparse.Namespace) -> list[str]:
    given = getattr(args, "endpoints", "completions")
    return [name.strip() for name in given.split(",") if name.strip()]


# -- the server's state ---------------------------------------------------------------------------
def metric(url: str, name: str, headers: dict[str, str]) -> float:
    text = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    if not values:
        raise RuntimeError(f"the server does not export {name}")
    return sum(values)


def wait_idle(url: str, headers: dict[str, str], timeout: float = IDLE_TIMEOUT_S) -> float:
    """Seconds until nothing runs or waits; raises if that takes longer than `timeout`."""
    start = time.monotonic()
    while (metric(url, "nanoserve:num_requests_running", headers)
           or metric(url, "nanoserve:num_requests_waiting", headers)):
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"the server was still busy {timeout:.0f} s after the run")
        time.sleep(0.1)
    return time.monotonic() - start


def process_tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue  # exited meanwhile
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
        stack.extend(int(c) for c in children)
    return total


def server_state(url: str, headers: dict[str, str], pid: int | None) -> ServerState:
    return ServerState(metric(url, "nanoserve:num_requests_running", headers),
                       metric(url, "nanoserve:num_requests_waiting", headers),
                       metric(url, "nanoserve:kv_cache_blocks_in_use", headers),
                       None if pid is None else process_tree_rss(pid))


# -- the whole benchmark --------------------------------------------------------------------------
@dataclass
class ChaosReport:
    outcomes: list[Outcome]
    mismatches: list[tuple[str, str, str]]  # prompt, chaos text, undisturbed text
    before: ServerState
    after: ServerState
    drain_seconds: float
    seconds: float

    @property
    def finished(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.behaviour in ("finish", "slow")]

    @property
    def unfinished_survivors(self) -> list[Outcome]:
        """Requests that should have completed but did not."""
        return [o for o in self.finished if not o.completed or o.finish_reason != "length"]

    @property
    def rss_growth(self) -> float | None:
        if self.before.rss_bytes is None or self.after.rss_bytes is None:
            return None
        return self.after.rss_bytes / self.before.rss_bytes - 1.0

    def lines(self) -> list[str]:
        counts = Counter((o.behaviour, o.completed) for o in self.outcomes)
        routes = Counter(o.endpoint for o in self.outcomes)
        rows = [f"{len(self.outcomes)} requests in {self.seconds:.1f} s "
                f"({', '.join(f'{n} {name}' for name, n in routes.items())}):"]
        for behaviour in BEHAVIOURS:
            total = counts[(behaviour, True)] + counts[(behaviour, False)]
            rows.append(f"  {behaviour:<10} {total:4d}  completed {counts[(behaviour, True)]:4d}"
                        f"  cut off {counts[(behaviour, False)]:4d}")
        rows.append(f"survivors (finish + slow) not complete: {len(self.unfinished_survivors)}; "
                    f"texts unequal to an undisturbed rerun: {len(self.mismatches)} of "
                    f"{len(self.finished)}")
        rows.append(f"before: {self.before.line()}")
        rows.append(f"after:  {self.after.line()} (idle {self.drain_seconds:.1f} s after the "
                    "last client)")
        growth = self.rss_growth
        if growth is not None:
            rows.append(f"resident memory after vs before: {growth * 100:+.1f}%")
        return rows

    def clean(self, rss_bound: float) -> bool:
        growth = self.rss_growth
        return (not self.unfinished_survivors and not self.mismatches
                and self.after.running == 0 and self.after.waiting == 0
                and self.after.kv_blocks_in_use == 0
                and (growth is None or growth <= rss_bound))


def run_chaos(url: str, args: argparse.Namespace, pid: int | None = None) -> ChaosReport:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    async def model_name() -> str:
        async with make_session(1) as session:
            return (await served_model_name(session, url, headers) or args.model
                    or DEFAULT_MODEL_NAME)

    model = asyncio.run(model_name())
    warm_prompts = make_prompts(args.concurrency, args.input_len, seed=args.seed + 1)
    asyncio.run(run_clients(url, model, warm_prompts, ["finish"] * len(warm_prompts), args,
                            headers))
    wait_idle(url, headers)
    before = server_state(url, headers, pid)

    prompts = make_prompts(args.num_requests, args.input_len, seed=args.seed)
    behaviours = plan(args.num_requests, args)
    start = time.perf_counter()
    outcomes = asyncio.run(run_clients(url, model, prompts, behaviours, args, headers))
    seconds = time.perf_counter() - start
    drain = wait_idle(url, headers)
    after = server_state(url, headers, pid)

    # the same requests again, undisturbed: greedy answers must not depend on the neighbours
    survivors = [o for o in outcomes if o.behaviour in ("finish", "slow") and o.completed]
    again = asyncio.run(run_clients(url, model, [o.prompt for o in survivors],
                                    ["finish"] * len(survivors), args, headers,
                                    [o.endpoint for o in survivors]))
    mismatches = [(o.prompt, o.text, a.text) for o, a in zip(survivors, again, strict=True)
                  if o.text != a.text]
    wait_idle(url, headers)
    return ChaosReport(outcomes, mismatches, before, after, drain, seconds)


def run_chaos_bench(args: argparse.Namespace) -> int:
    from nanoserve.bench.serve import nanoserve_server

    if args.url is not None:
        report = run_chaos(args.url, args)
    else:
        with nanoserve_server(args.model, args.server_args.split()) as (url, pid):
            report = run_chaos(url, args, pid)
    for line in report.lines():
        print(line)
    if report.mismatches:
        prompt, got, expected = report.mismatches[0]
        print(f"first mismatch: prompt {prompt[:60]!r}: {got[:80]!r} vs {expected[:80]!r}",
              file=sys.stderr)
    clean = report.clean(args.rss_bound)
    print("nothing leaked" if clean else "LEAKED OR WRONG: see above")
    return 0 if clean else 1

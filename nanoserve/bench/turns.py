"""`nanoserve bench turns`: a conversation replayed turn by turn, as an agent sends it, with
the prefix cache on and off (and llama-server on the same GGUF with `--compare-llama-server`).

Turn 1's prompt is `--system-len` tokens (an agent's system prompt and tools); each later
turn's is the last one, an answer of `--answer-len` tokens and a new message of `--turn-len`,
so a server that keeps what it computed has all but the new part. Prompts are token ids
(seeded, the same for every server: no tokenizer between them), each request one greedy token,
timed from send to answer: its time to first token. Per turn the table gives each server's
time, the prompt tokens its usage reports as cached (`prompt_tokens_details.cached_tokens`;
llama-server's own count of the tokens it did not compute where it gives one), and the ratio
of the cache on to the cache off. On a hybrid model (Qwen3.5) a hit is where a DeltaNet state
snapshot is (engine/state_cache.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from nanoserve.bench.serve import gguf_for_llama_server, llama_server, nanoserve_server

FIRST_ID, LAST_ID = 1000, 20000  # ordinary text tokens in every vocabulary the benches use


@dataclass
class TurnTimes:
    server: str
    seconds: list[float] = field(default_factory=list)
    cached: list[int | None] = field(default_factory=list)


def conversation(args: argparse.Namespace) -> list[list[int]]:
    """Each turn's whole prompt (token ids)."""
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_ID, LAST_ID) for _ in range(n)]

    prompts = [ids(args.system_len)]
    for _ in range(args.turns - 1):
        prompts.append(prompts[-1] + ids(args.answer_len) + ids(args.turn_len))
    return prompts


def ask(url: str, model: str, prompt: list[int]) -> tuple[float, int | None]:
    """One greedy token for `prompt`: (seconds to the answer, tokens the server reused)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                       "cache_prompt": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as response:
        answer = json.loads(response.read())
    seconds = time.perf_counter() - start
    usage = answer.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    timings = answer.get("timings") or {}
    if cached is None and "prompt_n" in timings:  # llama-server: the tokens it computed
        cached = len(prompt) - int(timings["prompt_n"])
    return seconds, cached


def replay(name: str, url: str, model: str, prompts: list[list[int]]) -> TurnTimes:
    times = TurnTimes(name)
    for turn, prompt in enumerate(prompts, 1):
        seconds, cached = ask(url, model, prompt)
        times.seconds.append(seconds)
        times.cached.append(cached)
        print(f"{name}: turn {turn}, {len(prompt)} tokens, {seconds:.2f} s, cached {cached}",
              file=sys.stderr)
    return times


def format_turns(prompts: list[list[int]], runs: list[TurnTimes]) -> str:
    on, off = runs[0], runs[1]
    header = "| turn | prompt tokens | " + " | ".join(
        f"{r.server} s (cached)" for r in runs) + " | cache on / off |"
    lines = [header, "|---:|---:|" + "---:|" * len(runs) + "---:|"]
    for i, prompt in enumerate(prompts):
        cells = [f"{r.seconds[i]:.2f} ({r.cached[i] if r.cached[i] is not None else '?'})"
                 for r in runs]
        ratio = on.seconds[i] / off.seconds[i]
        lines.append(f"| {i + 1} | {len(prompt)} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return "\n".join(lines)


def run_turns_bench(args: argparse.Namespace) -> int:
    prompts = conversation(args)
    context = str(len(prompts[-1]) + 16)
    common = ["--max-model-len", context, *args.server_args.split()]
    runs = []
    for name, extra in (("cache on", []), ("cache off", ["--no-prefix-caching"])):
        with nanoserve_server(args.model, [*common, *extra]) as (url, _):
            runs.append(replay(name, url, _served_model(url), prompts))
    if args.compare_llama_server:
        gguf = gguf_for_llama_server(args.model)
        with llama_server(gguf, parallel=1, threads=args.llama_server_threads,
                          slot_tokens=int(context)) as (url, setting):
            runs.append(replay(f"llama-server ({setting})", url, "llama", prompts))
    print(format_turns(prompts, runs))
    return 0


def _served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as response:
        models: dict[str, Any] = json.loads(response.read())
    return str(models["data"][0]["id"])


def add_turns_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model to serve (default: the default)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-len", type=int, default=2000,
                   help="turn 1's prompt tokens (an agent's system prompt and tools)")
    p.add_argument("--answer-len", type=int, default=64,
                   help="tokens of each earlier answer in the next prompt")
    p.add_argument("--turn-len", type=int, default=64, help="tokens of each new message")
    p.add_argument("--server-args", default="",
                   help="more `nanoserve serve` flags, one string")
    p.add_argument("--compare-llama-server", action="store_true",
                   help="also replay it on llama-server (--parallel 1) over the same GGUF")
    p.add_argument("--llama-server-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)

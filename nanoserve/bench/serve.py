"""`nanoserve bench serve`: streaming load on an OpenAI-compatible server, beside llama.cpp's.

Each request is a streamed `POST /v1/completions` of a prompt of about `--input-len` tokens
(random common English words, seeded, so every server gets the same prompts), greedy, EOS
ignored, `--output-len` tokens. Several input lengths (`--input-len 2000,6000,12000`) run the
whole load once per length, each with its own prompts and its own tables; a length past the
model's context runs anyway (both servers are given the context it needs, nanoserve through
NANOSERVE_ALLOW_LONG_MAX_MODEL_LEN), since the time a prompt takes does not depend on what the
model learned. At each concurrency level `--num-requests` requests run with at
most that many in flight. Per level: output tokens/s over the wall time (first send to last
completion), requests/s, time to first token, inter-token latency and end-to-end latency.

With `--image-size WxH` each request is instead a streamed chat request with one random PNG of
its own before the words (image_load.py), and `--mmproj` gives both self-started servers the
vision tower (random_gemma3_vlm_gguf.py writes a pair of files both load).

Without `--url` it starts `nanoserve serve` itself on a free port. With `--compare-llama-server`
it builds llama.cpp's server (once, see llama_server.py), serves the same GGUF file with it, runs
the same load, and prints the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from nanoserve.bench.beside import OUTPUT_TOKENS, BesideStats, format_beside, run_beside
from nanoserve.bench.image_load import (
    CHAT_PATH,
    image_bodies,
    mmproj_tokens_per_image,
    parse_image_size,
)
from nanoserve.bench.load_client import (
    ServerRun,
    completion_body,
    format_comparison,
    format_table,
    make_prompts,
    make_session,
    parse_levels,
    requests_per_level,
    run_level,
    send_request,
    served_model_name,
    summarize,
)
from nanoserve.config import ALLOW_LONG_MAX_MODEL_LEN, DEFAULT_MODEL_NAME

HEALTH_TIMEOUT_S = 300.0


# ---------------------------------------------------------------------------------------------
# The client.


async def bench_server(name: str, url: str, model: str | None, args: argparse.Namespace,
                       levels: Sequence[int]) -> ServerRun:
    """Warm the server up with one short request, then run every level."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with make_session(max(levels)) as session:
        model = (model or await served_model_name(session, url, headers) or args.model
                 or DEFAULT_MODEL_NAME)
        warm_bodies, path = level_bodies(model, args, ["Hello"], 4,
                                          seed=args.seed * 1_000_003 + 999_999)
        warm = await send_request(session, url, warm_bodies[0], headers, path)
        if warm.error is not None:
            print(f"{name}: warm-up request failed: {warm.error}", file=sys.stderr)
        results = []
        for concurrency in levels:
            count = requests_per_level(concurrency, args.num_requests)
            # Each level has its own prompts so no server finds a previous level's in its cache.
            seed = args.seed * 1_000_003 + concurrency
            bodies, path = level_bodies(model, args, make_prompts(count, args.input_len, seed),
                                        args.output_len, seed)
            stats = summarize(await run_level(session, url, bodies, concurrency, headers, path),
                              concurrency)
            print(f"{name}: concurrency {concurrency}: {stats.requests} requests, "
                  f"{stats.failures} failed, {stats.tokens_per_s:.1f} tok/s", file=sys.stderr)
            results.append(stats)
        more = []
        if args.long_prompt_beside:
            more.append(format_beside(name, [await _beside(name, session, url, model, args,
                                                           level, headers) for level in levels]))
    return ServerRun(name, model, results, more)


def level_bodies(model: str, args: argparse.Namespace, prompts: list[str], output_len: int,
                 seed: int) -> tuple[list[dict[str, Any]], str]:
    """The requests of `prompts` and the path they go to: completions, or with
    `--image-size` chat requests with an image of their own each (seeded by `seed`, so both
    servers get the same images)."""
    if not args.image_size:
        return [completion_body(model, p, output_len) for p in prompts], "/v1/completions"
    size = parse_image_size(args.image_size)
    return image_bodies(model, prompts, size, output_len, seed * 1_000), CHAT_PATH


async def _beside(name: str, session: aiohttp.ClientSession, url: str, model: str,
                  args: argparse.Namespace, streams: int, headers: dict[str, str]
                  ) -> BesideStats:
    """`streams` of the level's requests, and a --long-prompt-beside prompt among them (the
    prompts are new: no prefix of a level before is in the cache)."""
    seed = args.seed * 1_000_003 + 500_000 + streams
    bodies = [completion_body(model, p, args.output_len)
              for p in make_prompts(streams, args.input_len, seed=seed)]
    long_prompt = make_prompts(1, args.long_prompt_beside, seed=seed + 1)[0]
    stats = await run_beside(session, url, bodies,
                             completion_body(model, long_prompt, OUTPUT_TOKENS),
                             args.long_prompt_beside, headers)
    print(f"{name}: {streams} streams beside a {args.long_prompt_beside}-token prompt: "
          f"its TTFT {stats.long_ttft:.1f} s", file=sys.stderr)
    return stats


# ---------------------------------------------------------------------------------------------
# Servers started by the benchmark.


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def nanoserve_server(model: str | None, extra_args: Sequence[str] = ()
                     ) -> Iterator[tuple[str, int]]:
    """`nanoserve serve` on a free port until the block ends (SIGTERM); yields its base URL
    and the launcher's pid (the engine and API processes are its children)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--port", str(port)]
    cmd += ["--model", model] if model else []
    cmd += list(extra_args)
    # The log goes to a file (to read after a failure), never to a pipe nobody reads, which
    # would block the server once full.
    fd, log_name = tempfile.mkstemp(prefix="nanoserve-serve-", suffix=".log")
    print(f"starting: {' '.join(cmd)} (log: {log_name})", file=sys.stderr)
    env = {**os.environ, ALLOW_LONG_MAX_MODEL_LEN: "1"} if "--max-model-len" in cmd else None
    with os.fdopen(fd, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env)
    with _ready(process, port, "nanoserve serve") as url:
        yield url, process.pid


def llama_slot_tokens(input_len: int, output_len: int) -> int:
    """The context each llama-server slot gets (it splits `--ctx-size` across `--parallel`
    slots and refuses a longer request with a 400): twice the request's length, as a prompt
    of `input_len` random words can run past `input_len` tokens, and at least 512."""
    return max(512, 2 * (input_len + output_len))


@contextlib.contextmanager
def llama_server(gguf: Path, parallel: int, threads: int, slot_tokens: int = 512,
                 binary: Path | None = None, extra_args: Sequence[str] = ()
                 ) -> Iterator[tuple[str, str]]:
    """llama-server (built if missing) on a free port until the block ends, `slot_tokens` of
    context for each of its `parallel` slots, `extra_args` after its own; yields its URL and
    its setting ("default", or `--no-repack` where the default one dies at start:
    `start_healthy_llama_server`)."""
    from nanoserve.bench.llama_server import (
        ensure_llama_server,
        start_healthy_llama_server,
        stop_process,
    )

    binary = binary or ensure_llama_server()
    port = free_port()
    process, setting = start_healthy_llama_server(
        binary, gguf, port, HEALTH_TIMEOUT_S, extra_args=extra_args, parallel=parallel,
        ctx_size=parallel * slot_tokens, threads=threads)
    try:
        print(f"llama-server is ready ({setting} setting)", file=sys.stderr)
        yield f"http://127.0.0.1:{port}", setting
    finally:
        stop_process(process)


def training_context_override(gguf: Path, slot_tokens: int) -> list[str]:
    """llama-server caps a slot at the model's training context (a longer request gets a
    400); for a load that needs more, the GGUF's `{arch}.context_length` is overridden to the
    slot's size, as nanoserve is given the context through --max-model-len."""
    from nanoserve.model.gguf_file import GGUFFile

    meta = GGUFFile(gguf).metadata
    key = f"{meta.get('general.architecture', 'llama')}.context_length"
    trained = meta.get(key)
    if trained is None or slot_tokens <= int(trained):
        return []
    return ["--override-kv", f"{key}=int:{slot_tokens}"]


@contextlib.contextmanager
def _ready(process: subprocess.Popen[bytes], port: int, name: str) -> Iterator[str]:
    """Wait for a started server's health check, yield its URL, stop it when the block ends."""
    from nanoserve.bench.llama_server import stop_process, wait_for_health

    try:
        url = f"http://127.0.0.1:{port}"
        waited = wait_for_health(url, HEALTH_TIMEOUT_S, process)
        print(f"{name} is ready after {waited:.1f} s", file=sys.stderr)
        yield url
    finally:
        stop_process(process)


def gguf_for_llama_server(model: str | None) -> Path:
    """The GGUF file both servers serve; llama-server reads nothing else."""
    from nanoserve.model.sources.fetch import local_model

    path = local_model(model)
    if path.suffix != ".gguf":
        raise ValueError(f"--compare-llama-server needs a GGUF model; {model!r} resolves to "
                         f"{path}")
    return path


# ---------------------------------------------------------------------------------------------
# Report.


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run the load on the server (and llama-server when comparing) at each input length;
    print the tables.

    Exit status 1 if any request failed, 2 if a server could not be built or started, else 0.
    """
    levels = parse_levels(args.concurrency)
    if args.image_size:
        try:
            parse_image_size(args.image_size)  # a bad size fails before any server starts
        except ValueError as e:
            print(f"nanoserve bench serve: error: {e}", file=sys.stderr)
            return 2
        if not (args.mmproj or args.url):
            print("nanoserve bench serve: error: --image-size needs --mmproj (the vision "
                  "tower both servers load) or --url", file=sys.stderr)
            return 2
    status = 0
    for one_length in per_input_length(args):
        status = max(status, _run_one_length(one_length, levels))
        if status == 2:
            break
    return status


def parse_input_lengths(text: str) -> list[int]:
    """'2000,6000' -> [2000, 6000]; each length must be positive."""
    lengths = [int(part) for part in str(text).split(",") if part.strip()]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--input-len needs positive integers, got {text!r}")
    return lengths


def per_input_length(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The arguments of each length's run: its `input_len`, and a seed of its own after the
    first, so no length's prompts are a prefix of another's (the first keeps the seed, and so
    the prompts, of a one-length run)."""
    return [argparse.Namespace(**{**vars(args), "input_len": length,
                                  "seed": args.seed + 7919 * i})
            for i, length in enumerate(parse_input_lengths(args.input_len))]


def _run_one_length(args: argparse.Namespace, levels: Sequence[int]) -> int:
    try:
        runs = [_bench_target(args, levels)]
        if args.compare_llama_server:
            runs.append(_bench_llama_server(args, levels))
    except (RuntimeError, TimeoutError) as e:
        print(f"nanoserve bench serve: error: {e}", file=sys.stderr)
        return 2

    image = (f", after one random {args.image_size} PNG each (a chat request)"
             if args.image_size else "")
    print(f"\n{args.input_len}-token prompts (random words){image} -> {args.output_len} output "
          "tokens each, streamed, greedy, EOS ignored; latencies in ms")
    for run in runs:
        print()
        print("\n".join(format_table(run)))
        for table in run.more_tables:
            print()
            print("\n".join(table))
    if len(runs) == 2:
        print()
        print("\n".join(format_comparison(runs[0], runs[1])))
    return 1 if any(s.failures for run in runs for s in run.levels) else 0


def _bench_llama_server(args: argparse.Namespace, levels: Sequence[int]) -> ServerRun:
    """The same load on llama-server serving the same GGUF file, in its best setting for each
    level: a server per level with a slot per request in flight (`--parallel 1` for one
    stream; more slots split its context and its batch)."""
    gguf = gguf_for_llama_server(args.model)
    threads = args.llama_server_threads or os.cpu_count() or 1
    runs = []
    settings: list[str] = []
    # started after the server under test has been stopped (when it was ours), so neither
    # takes CPU from the other's measurement
    for level in levels:
        slot_tokens = llama_slot_tokens(args.input_len + image_tokens(args), args.output_len)
        with llama_server(gguf, parallel=level, threads=threads, slot_tokens=slot_tokens,
                          extra_args=[*training_context_override(gguf, slot_tokens),
                                      *mmproj_args(args)]
                          ) as (url, setting):
            runs.append(asyncio.run(bench_server("llama-server", url, None, args, [level])))
            settings.append(setting)
    return ServerRun(peer_name(settings), runs[0].model, [run.levels[0] for run in runs],
                     [table for run in runs for table in run.more_tables])


def peer_name(settings: Sequence[str]) -> str:
    """llama-server's name in the tables, with the setting it ran in (beside its figures)."""
    return f"llama-server ({', '.join(dict.fromkeys(settings))} setting)"


def _bench_target(args: argparse.Namespace, levels: Sequence[int]) -> ServerRun:
    """The server under test: `--url`, or a `nanoserve serve` started for the run."""
    if args.url:
        # an explicit --model names what the server serves; else ask the server
        return asyncio.run(bench_server(args.url, args.url, args.model, args, levels))
    with nanoserve_server(args.model, [*context_args(args.model, args), *mmproj_args(args)]
                          ) as (url, _):
        return asyncio.run(bench_server("nanoserve", url, None, args, levels))


def context_args(model: str | None, args: argparse.Namespace) -> list[str]:
    """`--max-model-len` for a load whose requests need more than the model's context (the
    same context llama-server's slots get), else nothing: the server keeps its defaults."""
    from nanoserve.model.loader import load_arch

    needed = llama_slot_tokens(args.input_len + image_tokens(args), args.output_len)
    if needed <= load_arch(model).max_position_embeddings:
        return []
    return ["--max-model-len", str(needed)]


def mmproj_args(args: argparse.Namespace) -> list[str]:
    """`--mmproj FILE` for a server the benchmark starts (both take the flag), else nothing."""
    return ["--mmproj", str(args.mmproj)] if args.mmproj else []


def image_tokens(args: argparse.Namespace) -> int:
    """The soft tokens each request's image adds to its prompt (0 without `--image-size`)."""
    if not (args.image_size and args.mmproj):
        return 0
    return mmproj_tokens_per_image(Path(args.mmproj))

"""The `nanoserve bench …` subcommands: each benchmark's flags, and the call that runs it.

The CLI (entrypoints/cli.py) adds them with `add_bench_commands`, handing in how it builds an
offline LLM. A benchmark's module is imported only when it runs, so `nanoserve --help` does not
load torch.
"""

from __future__ import annotations

import argparse
from functools import partial

from nanoserve.bench import LLMFactory
from nanoserve.bench.chaos_endpoints import ENDPOINTS
from nanoserve.engine_args import EngineArgs


def add_bench_commands(bench: argparse.ArgumentParser, build_llm: LLMFactory) -> None:
    """Add throughput, sampler, step, embed, quality, structured, detokenize, serve, chaos,
    proposer, spec and route under `bench`; each sets `func`."""
    sub = bench.add_subparsers(dest="bench", required=True)

    tput = sub.add_parser("throughput", help="offline batch throughput vs transformers generate")
    tput.add_argument("--num-prompts", type=int, default=64)
    tput.add_argument("--input-len", type=int, default=128)
    tput.add_argument("--output-len", type=int, default=128)
    tput.add_argument("--skip-single", action="store_true", help="skip the one-prompt scenario")
    tput.add_argument("--skip-transformers", action="store_true",
                      help="measure nanoserve only (no ratios)")
    tput.add_argument("--skip-roofline", action="store_true")
    tput.add_argument("--repeats", type=int, default=2,
                      help="rounds per scenario, the engines taking turns; the best of each "
                           "side counts (default: %(default)s)")
    EngineArgs.add_cli_args(tput)
    tput.set_defaults(func=partial(_run_throughput, build_llm=build_llm))

    samp = sub.add_parser("sampler", help="the batched sampler vs textbook samplers")
    samp.add_argument("--batch-sizes", default="1,32,256")
    samp.add_argument("--repeats", type=int, default=10)
    samp.add_argument("--skip-step-share", action="store_true")
    samp.add_argument("--mix", choices=("vllm", "llama"), default="vllm",
                      help="llama: llama.cpp's samplers (DRY, window, typical-p, top-n-sigma, "
                           "XTC, Mirostat) against the vLLM mix, one sampler (sampler_llama.py)")
    samp.add_argument("--history", type=int, default=1024,
                      help="with --mix llama: each row's prompt tokens (default: %(default)s)")
    EngineArgs.add_cli_args(samp)
    samp.set_defaults(func=partial(_run_sampler, build_llm=build_llm))

    step = sub.add_parser("step", help="one decode step's time split: matmuls, attention, "
                          "element-wise, sampler, engine")
    step.add_argument("--batch-sizes", default="1,8,64",
                      help="comma-separated decode batch sizes (default: 1,8,64)")
    step.add_argument("--context-len", type=int, default=256,
                      help="prompt tokens per request before the timed steps (default: 256)")
    step.add_argument("--repeats", type=int, default=10, help="timed steps (default: 10)")
    step.add_argument("--compare-eager", action="store_true",
                      help="also time each batch with the decoder layers as one native call "
                           "and as the Python loop (--enforce-eager), interleaved")
    step.add_argument("--compare-compiled", action="store_true",
                      help="also time each batch with the decoder layers as one native call "
                           "and as the kernels' layer loop under torch.compile (Inductor, C++ "
                           "wrapper; compiling takes minutes), interleaved")
    step.add_argument("--rows-curve", type=int, default=0, metavar="K",
                      help="also time one request's step as it scores 1 + k rows, k = 0..K "
                           "(what a speculative verify costs; default: off)")
    EngineArgs.add_cli_args(step)
    step.set_defaults(func=partial(_run_step, build_llm=build_llm))

    embed = sub.add_parser("embed", help="embedding throughput (inputs/s, tokens/s) vs "
                           "transformers on the same weights and pooling")
    _add_embed_args(embed)
    embed.set_defaults(func=partial(_run_embed, build_llm=build_llm))

    quality = sub.add_parser("quality", help="perplexity and greedy agreement of each "
                             "--quantization mode beside exact float32 (none)")
    quality.add_argument("--modes", default="none,gguf,int8,fp16",
                         help="comma-separated modes; none, the reference, is always measured "
                              "(default: %(default)s)")
    quality.add_argument("--text", default="tests/data/essay.txt",
                         help="plain-text file for the perplexity (default: %(default)s, "
                              "relative to the current directory: run from a checkout)")
    quality.add_argument("--num-tokens", type=int, default=4096,
                         help="tokens of the text to score (default: %(default)s)")
    quality.add_argument("--max-tokens", type=int, default=32,
                         help="greedy tokens per prompt (default: %(default)s)")
    quality.add_argument("--vs-llama-cpp", action="store_true",
                         help="perplexity counted as llama.cpp's llama-perplexity counts it "
                              "(chunks of --ctx-size, second halves scored), beside that "
                              "tool's own on the same GGUF file (built on first use)")
    quality.add_argument("--ctx-size", type=int, default=512,
                         help="--vs-llama-cpp's chunk length (default: %(default)s)")
    quality.add_argument("--threads", type=int, default=2,
                         help="llama-perplexity's threads (default: %(default)s)")
    EngineArgs.add_cli_args(quality)
    quality.set_defaults(func=partial(_run_quality, build_llm=build_llm))

    detok = sub.add_parser("detokenize",
                           help="incremental detokenization vs re-decoding, µs/token")
    detok.add_argument("--lengths", default="10,1000,4000")
    detok.add_argument("--model", default=None)
    detok.set_defaults(func=_run_detokenize)

    structured = sub.add_parser(
        "structured", help="structured outputs: a half-constrained batch's tok/s beside an "
        "unconstrained one, grammar compile times, free requests' ITL while a schema compiles")
    structured.add_argument("--batch", type=int, default=32,
                            help="requests in the throughput batch (default: %(default)s)")
    structured.add_argument("--input-len", type=int, default=64)
    structured.add_argument("--output-len", type=int, default=128)
    structured.add_argument("--itl-batch", type=int, default=8,
                            help="free requests decoding in the ITL test (default: %(default)s)")
    structured.add_argument("--itl-steps", type=int, default=200,
                            help="decode steps timed per ITL run (default: %(default)s)")
    structured.add_argument("--repeats", type=int, default=3,
                            help="alternating runs of each variant (default: %(default)s)")
    structured.add_argument("--parts", default="compile,throughput,itl",
                            help="comma-separated parts to run (default: %(default)s)")
    EngineArgs.add_cli_args(structured)
    structured.set_defaults(func=partial(_run_structured, build_llm=build_llm))

    serve = sub.add_parser(
        "serve", help="streaming load against a server (ours, or any OpenAI-compatible URL)")
    _add_serve_args(serve)
    serve.set_defaults(func=_run_serve)

    chaos = sub.add_parser(
        "chaos", help="misbehaving clients under load (disconnects, timeouts, slow readers), "
                      "then check that nothing leaked")
    _add_chaos_args(chaos)
    chaos.set_defaults(func=_run_chaos)

    proposer = sub.add_parser(
        "proposer", help="what the draft proposers cost per step, against a one-stream "
        "decode step (offline)")
    _add_proposer_args(proposer)
    EngineArgs.add_cli_args(proposer)
    proposer.set_defaults(func=partial(_run_proposer, build_llm=build_llm))

    spec = sub.add_parser(
        "spec", help="speculative decoding off vs on, and llama-server with its n-gram "
                     "speculation: copying workloads and open chat, the same requests, tok/s "
                     "and ITL, outputs compared")
    _add_spec_args(spec)
    spec.set_defaults(func=_run_spec)

    route = sub.add_parser(
        "route", help="cache-aware vs round-robin routing over 1-8 replicas, simulated on a "
                      "shared-prefix trace with the real prefix cache (no model)")
    _add_route_args(route)
    route.set_defaults(func=_run_route)

    turns = sub.add_parser(
        "turns", help="a conversation replayed turn by turn (an agent's long first prompt, "
                      "then more each turn): time to first token with the prefix cache on "
                      "and off, and llama-server's")
    _add_turns_args(turns)
    turns.set_defaults(func=_run_turns)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `nanoserve bench serve` (a client: no engine flags)."""
    p.add_argument("--url", default=None,
                   help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 "
                        "(default: start `nanoserve serve` on a free port)")
    p.add_argument("--model", default=None,
                   help="model name to send (default: the server's first in /v1/models); for "
                        "the self-started server, the model to serve")
    p.add_argument("--concurrency", default="1,8,32",
                   help="comma-separated levels of requests in flight")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per level (default: max(2 x concurrency, 8))")
    p.add_argument("--input-len", default="128",
                   help="prompt tokens (about); comma-separated lengths run the whole load "
                        "at each, e.g. 2000,6000,12000 (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--compare-llama-server", action="store_true",
                   help="also run the same load on llama.cpp's llama-server (built on first "
                        "use, ~20 minutes on 2 cores) serving the same GGUF file")
    p.add_argument("--llama-server-threads", type=int, default=None,
                   help="llama-server --threads (default: the number of CPUs)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="llama.cpp's multimodal projector GGUF of --model, given to both "
                        "self-started servers (nanoserve serve and llama-server --mmproj)")
    p.add_argument("--image-size", default=None, metavar="WxH",
                   help="send each request as a chat request with one random PNG of this "
                        "size (its own per request: no cache helps) before its words, "
                        "e.g. 640x480; needs --mmproj unless --url")
    p.add_argument("--long-prompt-beside", type=int, default=0, metavar="TOKENS",
                   help="after the levels, per level: its streams decoding, then one prompt of "
                        "about this many tokens among them; prints the streams' gaps between "
                        "tokens alone and beside its prefill, and its time to first token")


def _add_embed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-inputs", type=int, default=128)
    p.add_argument("--input-len", type=int, default=128, help="tokens per input")
    p.add_argument("--hf-batch-size", type=int, default=32,
                   help="transformers' static batch (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds, the engines taking turns (default: %(default)s)")
    p.add_argument("--skip-transformers", action="store_true",
                   help="measure nanoserve only (no ratio)")
    EngineArgs.add_cli_args(p)


def _add_chaos_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None,
                   help="base URL of a running nanoserve (default: start `nanoserve serve` on "
                        "a free port; only then is its resident memory read)")
    p.add_argument("--model", default=None, help="the model to serve, or to name")
    p.add_argument("--server-args", default="",
                   help="extra flags for the self-started server, one string")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect-share", type=float, default=1 / 3,
                   help="streams closed after 1-8 chunks (default: a third)")
    p.add_argument("--timeout-share", type=float, default=1 / 6,
                   help="non-streamed requests whose client gives up after 0.2-2 s")
    p.add_argument("--slow-share", type=float, default=0.1,
                   help="streams that stop reading for 1-4 s after the first chunk")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (about)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--endpoints", default=",".join(ENDPOINTS),
                   help="the routes the clients use, in turns (default: all of "
                        f"{', '.join(ENDPOINTS)})")
    p.add_argument("--rss-bound", type=float, default=0.05,
                   help="allowed growth of the server's resident memory (default: 5%%)")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--seed", type=int, default=0)


def _run_chaos(args: argparse.Namespace) -> int:
    from nanoserve.bench.chaos import run_chaos_bench

    return run_chaos_bench(args)


def _run_throughput(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    from nanoserve.bench.throughput import run_throughput_bench

    return run_throughput_bench(args, build_llm)


def _run_sampler(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    if args.mix == "llama":
        from nanoserve.bench.sampler_llama import run_llama_mix_bench

        return run_llama_mix_bench(args, build_llm)
    from nanoserve.bench.sampler import run_sampler_bench

    return run_sampler_bench(args, build_llm)


def _run_step(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    from nanoserve.bench.step import run_step_profile

    run_step_profile(build_llm(EngineArgs.from_cli_args(args)).engine, args)
    return 0


def _run_embed(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    from nanoserve.bench.embed import run_embed_bench

    return run_embed_bench(args, build_llm)


def _run_quality(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    from nanoserve.bench.quality import run_quality_bench

    return run_quality_bench(args, build_llm)


def _run_structured(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    from nanoserve.bench.structured import run_structured_bench

    return run_structured_bench(args, build_llm)


def _run_detokenize(args: argparse.Namespace) -> int:
    from nanoserve.bench.detokenize import run_detokenize_bench

    return run_detokenize_bench(args)


def _run_serve(args: argparse.Namespace) -> int:
    from nanoserve.bench.serve import run_serve_bench

    return run_serve_bench(args)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    from nanoserve.bench.spec import add_spec_args

    add_spec_args(p)


def _run_spec(args: argparse.Namespace) -> int:
    from nanoserve.bench.spec import run_spec_bench

    return run_spec_bench(args)


def _add_proposer_args(p: argparse.ArgumentParser) -> None:
    from nanoserve.bench.proposer import add_proposer_args

    add_proposer_args(p)


def _add_route_args(p: argparse.ArgumentParser) -> None:
    from nanoserve.bench.route import add_route_args

    add_route_args(p)


def _run_route(args: argparse.Namespace) -> int:
    from nanoserve.bench.route import run_route_bench

    return run_route_bench(args)


def _add_turns_args(p: argparse.ArgumentParser) -> None:
    from nanoserve.bench.turns import add_turns_args

    add_turns_args(p)


def _run_turns(args: argparse.Namespace) -> int:
    from nanoserve.bench.turns import run_turns_bench

    return run_turns_bench(args)


def _run_proposer(args: argparse.Namespace, build_llm: LLMFactory) -> int:
    from nanoserve.bench.proposer import run_proposer_bench

    return run_proposer_bench(args, build_llm)

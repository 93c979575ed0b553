"""The `nanoserve` command: generate, chat, bench.

    nanoserve generate "The capital of France is" --max-tokens 20
    nanoserve chat
    nanoserve bench throughput
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from nanoserve.config import SchedulerConfig
from nanoserve.model.loader import DEFAULT_MODEL_NAME


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that build the engine (shared by every command that runs a model)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help=f"HF model directory or .gguf file (default: {DEFAULT_MODEL_NAME})")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=SchedulerConfig.max_num_batched_tokens,
                   help="tokens in one forward pass; smaller chunks long prefills finer, which "
                        "lowers time-to-first-token under load (default: %(default)s)")
    g.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="KV cache size in GiB (default: 1 on CPU, 90%% of free GPU memory)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--logits-processors", default="", metavar="MODULE:CLASS[,...]",
                   help="custom logits processors to load (entry points of the group "
                        "nanoserve.logits_processors are always loaded)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most top-N logprobs a request may ask for")


def engine_config(args: argparse.Namespace) -> Any:
    from nanoserve.config import (
        CacheConfig,
        EngineConfig,
        GiB,
        ModelConfig,
        SamplerConfig,
        SchedulerConfig,
    )

    return EngineConfig(
        model=ModelConfig(model=args.model, device=args.device, dtype=args.dtype,
                          max_model_len=args.max_model_len, seed=args.seed,
                          zero_cost_runner=getattr(args, "zero_cost_engine", False)),
        cache=CacheConfig(block_size=args.block_size,
                          kv_cache_memory_bytes=None if args.kv_cache_memory is None
                          else int(args.kv_cache_memory * GiB),
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens),
        sampler=SamplerConfig(logits_processors=tuple(
            s for s in args.logits_processors.split(",") if s), max_logprobs=args.max_logprobs),
    )


def build_llm(args: argparse.Namespace) -> Any:
    from nanoserve.entrypoints.llm import LLM

    return LLM.from_config(engine_config(args))


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--sample-seed", type=int, default=None, help="seed of the request")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--extra-args", type=json.loads, default=None, metavar="JSON",
                   help='per-request arguments for logits processors, e.g. '
                        '\'{"no_repeat_ngram_size": 3}\'')


def sampling_params(args: argparse.Namespace) -> Any:
    from nanoserve.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                          seed=args.sample_seed, ignore_eos=args.ignore_eos, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty,
                          extra_args=args.extra_args)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = build_llm(args)
    params = sampling_params(args)
    prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    if not args.chat:
        print(args.prompt, end="", flush=True)
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A terminal chat: the history grows turn by turn; Ctrl-C stops a reply, Ctrl-D quits."""
    llm = build_llm(args)
    params = sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print(f"nanoserve chat with {llm.engine.loaded.name} (Ctrl-D or /quit to leave)")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/quit", "/exit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = []
        try:
            for delta in llm.stream(history, params):
                reply.append(delta)
                print(delta, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(args: argparse.Namespace) -> int:
    from nanoserve.config import ServerConfig, api_key_from_env
    from nanoserve.entrypoints.serve import run_serve

    if args.model_positional and args.model is None:
        args.model = args.model_positional
    server = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key or api_key_from_env(),
        served_model_name=args.served_model_name, reasoning_parser=args.reasoning_parser,
        api_server_count=args.api_server_count, shutdown_timeout=args.shutdown_timeout,
        max_in_flight=args.max_in_flight, generation_config=args.generation_config,
        log_level=args.log_level)
    return run_serve(engine_config(args), server)


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from nanoserve.bench.throughput import run_throughput_bench

    return run_throughput_bench(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from nanoserve.bench.serve import run_serve_bench

    return run_serve_bench(args)


def cmd_bench_detokenize(args: argparse.Namespace) -> int:
    from nanoserve.bench.detokenize import run_detokenize_bench

    return run_detokenize_bench(args)


def cmd_bench_sampler(args: argparse.Namespace) -> int:
    from nanoserve.bench.sampler import run_sampler_bench

    return run_sampler_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt, printing tokens as they come")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message through the chat template")
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    serve.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                       help="HF model directory or .gguf file (default: the default model)")
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or set NANOSERVE_API_KEY)")
    g.add_argument("--served-model-name", default=None)
    from nanoserve.output.reasoning import REASONING_PARSERS

    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None)
    g.add_argument("--api-server-count", type=int, default=1)
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish on SIGTERM")
    g.add_argument("--max-in-flight", type=int, default=512,
                   help="requests in flight past which new ones get HTTP 429")
    g.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="auto: the model's generation_config sampling defaults; vllm: vLLM's")
    g.add_argument("--log-level", default="info")
    g.add_argument("--zero-cost-engine", action="store_true",
                   help="benchmark the frontend: skip the model, emit tokens at once")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks that print figures beside a peer's")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    tput = bench_sub.add_parser("throughput",
                                help="offline batch throughput vs transformers generate")
    from nanoserve.bench.throughput import add_throughput_args

    add_throughput_args(tput)
    add_engine_args(tput)
    tput.set_defaults(func=cmd_bench_throughput)
    samp = bench_sub.add_parser("sampler", help="the batched sampler vs textbook samplers")
    from nanoserve.bench.sampler import add_sampler_args

    add_sampler_args(samp)
    add_engine_args(samp)
    samp.set_defaults(func=cmd_bench_sampler)
    detok = bench_sub.add_parser("detokenize",
                                 help="incremental detokenization vs re-decoding, µs/token")
    from nanoserve.bench.detokenize import add_detokenize_args

    add_detokenize_args(detok)
    detok.set_defaults(func=cmd_bench_detokenize)
    serve_bench = bench_sub.add_parser(
        "serve", help="streaming load against a server (ours, or any OpenAI-compatible URL)")
    from nanoserve.bench.serve import add_serve_bench_args

    add_serve_bench_args(serve_bench)
    serve_bench.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (FileNotFoundError, ValueError) as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

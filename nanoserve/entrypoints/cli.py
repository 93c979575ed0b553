"""The `nanoserve` command: generate, chat, serve, bench.

    nanoserve generate "The capital of France is" --max-tokens 20
    nanoserve chat
    nanoserve bench throughput
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from nanoserve.bench.cli import add_bench_commands
from nanoserve.engine_args import EngineArgs
from nanoserve.entrypoints.model_by_name import with_local_model
from nanoserve.entrypoints.model_commands import add_model_commands
from nanoserve.entrypoints.serve_flags import (
    add_image_args,
    add_key_and_tls_args,
    add_limit_args,
    image_limits,
)
from nanoserve.entrypoints.serving.chat_defaults import chat_defaults, describe
from nanoserve.native import check_cpu_isa
from nanoserve.parsers.reasoning import REASONING_PARSERS
from nanoserve.parsers.tool_calls import TOOL_CALL_PARSERS
from nanoserve.sampling_params import SamplingParams
from nanoserve.server_config import (
    RequestLimits,
    ServerConfig,
    check_tls_files,
    read_api_keys,
)

if TYPE_CHECKING:
    from nanoserve.entrypoints.llm import LLM


def build_llm(engine_args: EngineArgs) -> LLM:
    """The offline engine. Imported here, when a command runs: `--help` never loads torch."""
    from nanoserve.entrypoints.llm import LLM

    return LLM.from_engine_args(engine_args)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--sample-seed", type=int, default=None, help="seed of the request")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    g.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    g.add_argument("--min-p", type=float, default=SamplingParams.min_p)
    g.add_argument("--repetition-penalty", type=float,
                   default=SamplingParams.repetition_penalty)
    g.add_argument("--extra-args", type=json.loads, default=None, metavar="JSON",
                   help='per-request arguments for logits processors, e.g. '
                        '\'{"no_repeat_ngram_size": 3}\'')


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                          seed=args.sample_seed, ignore_eos=args.ignore_eos, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty,
                          extra_args=args.extra_args)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = build_llm(EngineArgs.from_cli_args(args))
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
    llm = build_llm(EngineArgs.from_cli_args(args))
    # settings for a person: the model's own, else a tail-cutting preset; flags given win
    defaults = chat_defaults(llm.engine.model_info.generation_config, llm.engine.max_model_len)
    for name, value in defaults.sampling().items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    params = sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    # the name as given (a hub name, not its cache path), else the model's own
    print(f"nanoserve chat with {args.model or llm.engine.model_info.name} (Ctrl-D or /quit "
          "to leave)")
    print(describe(vars(args), defaults.source))
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


TUNE_BUDGET_S = 600.0  # `nanoserve tune` is asked for and waited on: room for the step check


def cmd_tune(args: argparse.Namespace) -> int:
    """`nanoserve tune`: every shape class of the model timed again (--kernel-tuning force),
    then the tuned schedule against the built-in one on whole steps, the tables printed; later
    starts on this machine read the choices."""
    from nanoserve.engine.model_runner import ModelRunner
    from nanoserve.kernel_tuning.report import format_result
    from nanoserve.kernel_tuning.tuner import tune_kernels

    if args.model_positional is not None:
        args.model = args.model_positional
    engine_args = replace(EngineArgs.from_cli_args(args), kernel_tuning="off")
    llm = build_llm(engine_args)
    runner = llm.engine.executor.local_worker.runner
    assert isinstance(runner, ModelRunner), "a tuning run has a model (no zero-cost runner)"
    result = tune_kernels(runner.model, runner, "force", budget_s=TUNE_BUDGET_S,
                          log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_result(result))
    return 0


def read_chat_template(value: str) -> str:
    """`--chat-template`: the template text itself (anything with `{{` or `{%`, as vLLM tells
    them apart) or the path of a file holding it; its Jinja syntax is checked here, at start-up."""
    import jinja2
    import jinja2.ext

    if "{{" in value or "{%" in value:
        text = value
    else:
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"chat template file '{value}' does not exist (--chat-template "
                             "takes a file's path or the Jinja template itself)")
        text = path.read_text()
    try:  # transformers renders with the loop-control extension; so parse with it too
        jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e.message} "
                         f"(line {e.lineno})") from None
    return text


def cmd_serve(args: argparse.Namespace) -> int:
    from nanoserve.entrypoints.launcher import run_serve

    engine_args = EngineArgs.from_cli_args(args)
    if args.model_positional and engine_args.model is None:
        engine_args = replace(engine_args, model=args.model_positional)
    if args.models_dir is None:  # a wrong path: one line now; a name: downloaded now
        engine_args, name = with_local_model(engine_args)
        args.served_model_name = args.served_model_name or name
    check_tls_files(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
    server = ServerConfig(
        host=args.host, port=args.port,
        api_keys=read_api_keys(args.api_key, args.api_key_file),
        ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        served_model_name=args.served_model_name, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser, score_method=args.score_method,
        chat_template=None if args.chat_template is None else read_chat_template(
            args.chat_template),
        api_server_count=args.api_server_count, shutdown_timeout=args.shutdown_timeout,
        max_in_flight=args.max_in_flight, generation_config=args.generation_config,
        log_level=args.log_level, limits=RequestLimits(
            max_request_body_bytes=args.max_request_body_bytes, max_n=args.max_n,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_length=args.max_stop_string_length,
            max_bad_words=args.max_bad_words,
            request_timeout=args.request_timeout,
            slow_reader_timeout=args.slow_reader_timeout,
            max_unread_updates=args.max_unread_updates, images=image_limits(args)),
        allowed_origins=tuple(args.allowed_origins), log_requests=args.log_requests,
        web_ui=not args.no_web_ui, strip_billing_header=not args.keep_billing_header,
        stopped_by_parent=args.stopped_by_parent)
    if args.models_dir is not None:  # several models, each its own server behind a router
        from nanoserve.entrypoints.router.run import run_router

        return run_router(args, server, args.raw_argv)
    return run_serve(engine_args.to_config(), server)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt, printing tokens as they come")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message through the chat template")
    EngineArgs.add_cli_args(gen)
    add_sampling_args(gen, max_tokens=128)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    serve.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                       help="HF model directory or .gguf file (default: the default model)")
    g = serve.add_argument_group("server")
    g.add_argument("--host", default=ServerConfig.host)
    g.add_argument("--port", type=int, default=ServerConfig.port)
    g.add_argument("--served-model-name", default=ServerConfig.served_model_name)
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   default=ServerConfig.reasoning_parser)
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   default=ServerConfig.tool_call_parser,
                   help='the model\'s tool-call format, read when tool_choice is "auto" '
                        "(default: the one the chat template writes; hermes if it has none)")
    g.add_argument("--score-method", choices=("yes_no", "cosine"),
                   default=ServerConfig.score_method,
                   help="how /v1/rerank and /score score a document: yes_no (the logit of "
                        "'yes' against 'no' after a judging prompt, as Qwen3-Reranker) | cosine "
                        "(of the two embeddings) (default: %(default)s)")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the text) replacing the model's")
    g.add_argument("--api-server-count", type=int, default=ServerConfig.api_server_count)
    g.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout,
                   help="seconds in-flight requests may take to finish when the server is "
                        "stopped (SIGTERM, SIGINT or SIGHUP; a second signal stops at once)")
    g.add_argument("--max-in-flight", type=int, default=ServerConfig.max_in_flight,
                   help="sequences in flight (each request's n samples count) past which "
                        "new requests get HTTP 429")
    g.add_argument("--generation-config", choices=("auto", "vllm"),
                   default=ServerConfig.generation_config,
                   help="auto: the model's generation_config sampling defaults; vllm: vLLM's")
    g.add_argument("--log-level", default=ServerConfig.log_level)
    g.add_argument("--log-requests", action="store_true",
                   help="log each request's prompt and sampling parameters (default: only its "
                        "id and sizes)")
    g.add_argument("--allowed-origins", nargs="+", default=list(ServerConfig.allowed_origins),
                   metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS), e.g. "
                        "http://localhost:3000, or '*' (default: none, no CORS headers)")
    g.add_argument("--no-web-ui", action="store_true",
                   help="serve neither the chat page (/) nor the dashboard (/dashboard)")
    g.add_argument("--keep-billing-header", action="store_true",
                   help="keep the x-anthropic-billing-header line Claude Code puts at the start "
                        "of its system prompt (by default it is removed: its cch= changes every "
                        "request, which would defeat the prefix cache)")
    # a router's model servers only (router/model_server.py): not for users, so not in --help
    g.add_argument("--stopped-by-parent", action="store_true", help=argparse.SUPPRESS)
    g = serve.add_argument_group("several models (llama-server's router mode, Ollama's loading)")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every .gguf file and HF model directory in DIR, each named by "
                        "its file stem or directory name, loaded on its first request (in "
                        "place of a MODEL)")
    g.add_argument("--models-max", type=int, default=4,
                   help="with --models-dir: the most models loaded at once; past it the least "
                        "recently used unloads (default: %(default)s)")
    g.add_argument("--keep-alive", type=float, default=300.0, metavar="SECONDS",
                   help="with --models-dir: unload a model idle this long; -1 keeps it "
                        "(Ollama's default and meaning; a request's keep_alive overrides it) "
                        "(default: %(default)s)")
    g.add_argument("--allow-pull", action="store_true",
                   help="with --models-dir: a request for a model that is not here pulls it "
                        "by name (qwen3.5:0.8b, org/repo:Q4_K_M) and answers once it is loaded "
                        "(default: a 404 that says how to pull it, as Ollama's)")
    add_key_and_tls_args(serve)
    add_limit_args(serve)
    add_image_args(serve)
    EngineArgs.add_cli_args(serve)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    EngineArgs.add_cli_args(chat)
    add_sampling_args(chat, max_tokens=512)
    # unset: cmd_chat fills them from the model's defaults or the chat preset
    chat.set_defaults(func=cmd_chat, temperature=None, top_p=None, top_k=None, min_p=None,
                      repetition_penalty=None, max_tokens=None)

    tune = sub.add_parser("tune", help="time the CPU kernels' schedules for a model on this "
                          "machine, keep the fastest for later starts, print the table")
    tune.add_argument("model_positional", nargs="?", metavar="MODEL", default=None,
                      help="the model (default: --model, else the default model)")
    EngineArgs.add_cli_args(tune)
    tune.set_defaults(func=cmd_tune)

    bench = sub.add_parser("bench", help="benchmarks that print figures beside a peer's")
    add_bench_commands(bench, build_llm)
    add_model_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)  # for the router's models
    try:
        check_cpu_isa()  # a tier asked for that the CPU lacks: an error now, not in the engine
        return int(args.func(args))
    except (FileNotFoundError, ValueError) as e:  # what a user gave cannot start: one line
        print(f"nanoserve {args.command}: error: {e}", file=sys.stderr)
        return 1


def run() -> NoReturn:
    """The `nanoserve` command: `main`, then out without the interpreter's teardown of torch
    and transformers (~1.2 s on 2 cores; process_exit.py), everything it started stopped."""
    from nanoserve.entrypoints.serving.process_exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()

"""`nanoserve serve --models-dir DIR`: the router process. It imports no torch and loads no
model itself; each model's server is a `nanoserve serve` of its own (model_server.py), given
the same command-line options as the router's, but for those only the router can use. It
serves the directory's models and those pulled by name (pulled_models.py); with
`--allow-pull`, it pulls a model a request names that nobody has pulled yet."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator

import uvicorn

from nanoserve.engine.launch import ENGINE_EXIT_WAIT_S
from nanoserve.engine.stop_signals import STOP_SIGNALS, StopRequests
from nanoserve.entrypoints.router.app import build_router_app
from nanoserve.entrypoints.router.catalog import find_models
from nanoserve.entrypoints.router.pool import ModelPool
from nanoserve.entrypoints.router.pulled_models import PulledModels
from nanoserve.entrypoints.serving.closing_server import ClosingServer
from nanoserve.entrypoints.serving.event_loop import run_event_loop
from nanoserve.entrypoints.serving.listen import AddressInUseError, bind_listening_socket
from nanoserve.entrypoints.web.router import page_banner
from nanoserve.model.sources.store import list_pulled
from nanoserve.server_config import ServerConfig

# options of the router itself, with how many values each takes (-1: one or more)
_ROUTER_ONLY = {"--models-dir": 1, "--models-max": 1, "--keep-alive": 1, "--host": 1,
                "--port": 1, "--served-model-name": 1, "--model": 1, "--allowed-origins": -1,
                "--no-web-ui": 0, "--stopped-by-parent": 0, "--allow-pull": 0,
                "--hf-token": 1,
                # TLS is the router's: its model servers answer it alone, on loopback
                "--ssl-certfile": 1, "--ssl-cert-file": 1, "--ssl-keyfile": 1,
                "--ssl-key-file": 1, "--ssl-ca-certs": 1, "--ssl-cert-reqs": 1}
_LOAD_TIMEOUT_S = 900.0  # a model's start, as long as the single server's engine may take


def child_args(argv: list[str]) -> list[str]:
    """`nanoserve serve`'s arguments, less `serve` and the router's own options: what every
    model's server is started with (its model path, port and name are added to these)."""
    out: list[str] = []
    rest = list(argv)
    if rest and rest[0] == "serve":
        rest = rest[1:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        flag = arg.split("=", 1)[0]
        if flag in _ROUTER_ONLY:
            takes = _ROUTER_ONLY[flag]
            i += 1
            if "=" not in arg and takes == 1:
                i += 1
            elif "=" not in arg and takes == -1:
                while i < len(rest) and not rest[i].startswith("-"):
                    i += 1
            continue
        out.append(arg)
        i += 1
    return out


def run_router(args: argparse.Namespace, server: ServerConfig, argv: list[str]) -> int:
    """Serve every model in `--models-dir` on one port until stopped. Returns the exit
    status."""
    logging.basicConfig(level=server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_positional or args.model:
        raise ValueError("give either a MODEL or --models-dir, not both")
    pulled_now = [m for m in list_pulled() if m.path.exists()]
    models = find_models(args.models_dir, may_be_empty=args.allow_pull or bool(pulled_now))
    keep_alive = None if args.keep_alive < 0 else float(args.keep_alive)
    stops = StopRequests(STOP_SIGNALS)
    # a model's server gets the drain's time, then its engine's to write its disk tier
    pool = ModelPool(models, child_args(argv), models_max=args.models_max,
                     keep_alive=keep_alive, load_timeout=_LOAD_TIMEOUT_S,
                     max_waiting=server.max_in_flight,
                     stop_grace=server.shutdown_timeout + ENGINE_EXIT_WAIT_S)
    try:
        sock = bind_listening_socket(server.host, server.port)
    except AddressInUseError as e:
        print(f"nanoserve serve: {e.strerror}", file=sys.stderr, flush=True)
        return 1
    pulled = PulledModels(pool, allow_pull=args.allow_pull, token=args.hf_token)
    for model in pulled_now:
        pulled.serve(model)
    app = build_router_app(pool, server, pulled)
    config = uvicorn.Config(app, log_level=server.log_level, access_log=False,
                            timeout_graceful_shutdown=max(1, int(server.shutdown_timeout)),
                            **server.tls_options())
    kept = "kept loaded" if keep_alive is None else f"unloaded after {keep_alive:g} s idle"
    names = ", ".join([*models, *pulled.records]) or "none yet"
    more = ("a model a request names is pulled if it is not here (--allow-pull)"
            if args.allow_pull else "more with `nanoserve pull NAME` or /api/pull")
    print(f"Serving {len(models) + len(pulled.records)} models ({names}): the files of "
          f"{args.models_dir} and those pulled by name; {more}; loaded on first use, at most "
          f"{args.models_max} at once, {kept}", flush=True)
    if server.web_ui:
        print(page_banner(server.host, server.port, "any of them", server.scheme), flush=True)

    async def main() -> int:
        router = _RouterServer(config, pool)
        stops.on_stop(router.stop_requested)
        if stops.requested:  # stopped while it was starting
            return 0
        await router.serve(sockets=[sock])
        return 0

    try:
        return run_event_loop(main())
    finally:
        sock.close()


class _RouterServer(ClosingServer):
    """uvicorn, except that a stop signal (SIGTERM, SIGINT or SIGHUP, to the router alone or to
    its whole group: the model servers ignore them) ends the process with status 0 once its
    requests have finished and every model's server has drained and stopped (the app's
    lifespan), not by the signal again as uvicorn's own handler does; a second signal stops at
    once, the model servers killed."""

    def __init__(self, config: uvicorn.Config, pool: ModelPool) -> None:
        super().__init__(config)
        self.pool = pool

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the process's StopRequests call
        yield  # stop_requested instead of uvicorn's handlers

    def stop_requested(self, count: int) -> None:
        if count > 1:
            self.force_exit = True
            self.pool.kill_all()
        self.should_exit = True

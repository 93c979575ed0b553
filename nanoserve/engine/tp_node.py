"""A headless node: its tensor-parallel ranks, and no engine core and no API server.

`nanoserve serve --tensor-parallel-size N --nnodes M --node-rank R --headless` (R > 0) runs
ranks [R * N / M, (R + 1) * N / M) as tp_worker.py processes, as vLLM's and SGLang's headless
nodes do. They meet rank 0 at `--master-addr`:`--master-port`, read from the rendezvous store
there where rank 0 publishes its steps (tcp), and run every step it publishes. This launcher
only starts and watches them, so a node started before node 0 just waits (up to the
distributed timeout) for rank 0 to listen. It exits once its ranks have: when rank 0 tells
them to stop (0), when rank 0 is gone or a rank fails (the first non-zero code; a rank
without its peers cannot go on, so the others are stopped). SIGTERM, SIGINT or SIGHUP (to
this process or its group) stops them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from nanoserve.config import EngineConfig
from nanoserve.engine.cores import split_cores
from nanoserve.engine.stop_signals import STOP_SIGNALS, StopRequests, held_for_children
from nanoserve.engine.tp_worker import start_worker, worker_config_bytes


def run_headless_node(config: EngineConfig) -> int:
    """Start this node's ranks, wait for them; the exit status."""
    parallel = config.parallel
    first, count = parallel.first_local_rank, parallel.num_local_ranks
    cores = split_cores(list(os.sched_getaffinity(0)), count)
    print(f"nanoserve: node {parallel.node_rank} of {parallel.nnodes}: tensor-parallel ranks "
          f"{first}..{first + count - 1} of {parallel.tensor_parallel_size}, meeting rank 0 at "
          f"{parallel.master_addr}:{parallel.master_port}", file=sys.stderr, flush=True)
    config_bytes = worker_config_bytes(config)
    stops = StopRequests(STOP_SIGNALS)
    with held_for_children():  # the ranks ignore stop signals: this process stops them
        procs = [start_worker(config_bytes, first + i, parallel.tensor_parallel_size,
                              parallel.master_port or 0, "", cores[i] if cores else None)
                 for i in range(count)]
    stops.on_stop(lambda _count: _terminate(procs))
    if stops.requested:
        _terminate(procs)
    try:
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.2)
        # one rank has left: the others cannot go on without it (nor without rank 0)
        _terminate(procs)
    finally:
        _terminate(procs)
    codes = [proc.returncode for proc in procs]
    return next((abs(code) for code in codes if code), 0)


def _terminate(procs: list[subprocess.Popen[bytes]]) -> None:
    """Every rank still running killed, then reaped: a rank has nothing of its own to keep,
    and cannot go on without the others (nor stop on a signal: it ignores them)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()

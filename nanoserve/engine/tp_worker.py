"""A tensor-parallel worker: ranks 1..N-1, each a process that runs only the forward.

A worker holds its shard of the weights and of the KV cache (its KV heads of every block, the
same block ids as rank 0) and follows the steps rank 0 publishes with rank 0's worker class
(worker.py, without a sampler): the same `StepInput` rank 0's own worker runs, so the ranks
meet in the same collectives in the same order (the all-reduces of every layer, the logits
gathered to rank 0). It has no scheduler, sampler, tokenizer or grammar: only rank 0 samples
(nano-vllm's `ModelRunner.loop`).

It is started as `python -m nanoserve.engine.tp_worker RANK WORLD PORT STEP_ADDRESS CORES`
(`start_worker`), the config as msgpack on stdin (never pickled). A rank on another node than
rank 0 is started by its node's headless launcher (tp_node.py) with no STEP_ADDRESS: it reads
the tcp address rank 0 published its steps on from the rendezvous store, and, its parent being
that launcher, checks that rank 0 is there by asking the store (which lives in rank 0). The
engine core runs in a daemonic multiprocessing child, which multiprocessing forbids to have
children of its own; a plain subprocess is the same fresh interpreter a spawn context would
give. A worker exits on `WorkerShutdown`, when rank 0 (or its launcher) is gone, or on any
error (a collective whose peer died raises): rank 0 notices the exit and fails the engine
(tp_executor.py).
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import traceback
from dataclasses import replace

import msgspec
import torch.distributed as dist
import zmq

from nanoserve.config import EngineConfig, SamplerConfig, SchedulerConfig
from nanoserve.engine.cores import pin_to_cores
from nanoserve.engine.memory import keep_freed_memory_in_heap
from nanoserve.engine.rank_build import build_rank
from nanoserve.engine.stop_signals import ignore_stop_signals
from nanoserve.engine.worker import Worker
from nanoserve.model.parallel import connect_rendezvous, destroy_group, init_group
from nanoserve.protocol import WorkerShutdown, decode_worker_message

_PARENT_CHECK_MS = 500  # how long an idle worker waits for a step before checking rank 0
STEP_ADDRESS_KEY = "nanoserve/step_address"  # rank 0's tcp step publisher, in the store


def worker_config_bytes(config: EngineConfig) -> bytes:
    """The config a worker reads on stdin: no scheduler or sampler settings (those may name
    classes, and only rank 0 schedules and samples)."""
    return msgspec.msgpack.encode(
        replace(config, scheduler=SchedulerConfig(), sampler=SamplerConfig()))


def start_worker(config_bytes: bytes, rank: int, world_size: int, port: int,
                 step_address: str, cores: list[int] | None) -> subprocess.Popen[bytes]:
    """Rank `rank` as a process of its own (`step_address` "" on a node without rank 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.engine.tp_worker", str(rank), str(world_size),
         str(port), step_address, ",".join(map(str, cores or []))], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(config_bytes)
    proc.stdin.close()
    return proc


def run_tp_worker(config: EngineConfig, rank: int, world_size: int, port: int,
                  step_address: str, cores: list[int] | None) -> int:
    """Join the group, load this rank's shard, run steps until told to stop; the exit code."""
    # 1) cores, the group, the shard and the KV cache rank 0 sized
    pin_to_cores(cores)
    keep_freed_memory_in_heap()  # as the engine core does: no page faults on each temporary
    parallel = config.parallel
    store = connect_rendezvous(parallel.master_addr, port, parallel.distributed_timeout_s)
    group = init_group(rank, world_size, parallel.master_addr, port, store=store,
                       timeout_s=parallel.distributed_timeout_s)
    is_remote = not step_address  # on another node than rank 0
    if is_remote:  # rank 0 set it before it joined the group
        step_address = store.get(STEP_ADDRESS_KEY).decode()
    # rank 0's worker class, without a sampler: it follows the steps (worker.py)
    worker = Worker(build_rank(config, group, engine_tokenizer=True).runner, sampler=None)
    gc.collect()
    gc.freeze()  # the loaded model out of the collector's sight, as in the engine core
    # 2) subscribe to the steps: rank 0 waits for every subscription before its first step
    context = zmq.Context()
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(step_address)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    parent = os.getppid()
    # 3) steps until shutdown, or until rank 0 is gone
    while True:
        if not sock.poll(_PARENT_CHECK_MS):
            if is_remote and not _store_answers(store):  # rank 0 is gone
                return 1
            if os.getppid() != parent:  # rank 0 (or the node's launcher) is gone
                if not is_remote:  # rank 0 was killed: it cleaned nothing up
                    shutil.rmtree(os.path.dirname(step_address.removeprefix("ipc://")),
                                  ignore_errors=True)
                return 1
            continue
        message = decode_worker_message(sock.recv())
        if isinstance(message, WorkerShutdown):
            break
        worker.follow(message)
    sock.close(linger=0)
    context.term()
    destroy_group(group)
    return 0


def _store_answers(store: dist.TCPStore) -> bool:
    """Whether rank 0's rendezvous store still answers (it lives in rank 0's process)."""
    try:
        store.check([STEP_ADDRESS_KEY])
    except Exception:  # DistNetworkError: the connection closed
        return False
    return True


def main(argv: list[str]) -> None:
    """Process entry point: exits with run_tp_worker's code, or 1 on any error."""
    ignore_stop_signals()  # rank 0 stops it (WorkerShutdown), or it leaves when rank 0 is gone
    rank, world_size, port = int(argv[0]), int(argv[1]), int(argv[2])
    cores = [int(c) for c in argv[4].split(",") if c]
    config = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=EngineConfig)
    status = 1
    try:
        status = run_tp_worker(config, rank, world_size, port, argv[3], cores or None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # no teardown that could wait on a dead peer


if __name__ == "__main__":
    main(sys.argv[1:])

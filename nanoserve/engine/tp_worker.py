"""A tensor-parallel worker: ranks 1..N-1, each a process that runs only the forward.

A worker holds its shard of the weights and of the KV cache (its KV heads of every block, the
same block ids as rank 0) and loops on the steps rank 0 publishes: the same `StepInput` rank
0's own worker runs, so the ranks meet in the same collectives in the same order (the
all-reduces of every layer, the logits gathered to rank 0). It has no scheduler, sampler,
tokenizer or grammar: only rank 0 samples (nano-vllm's `ModelRunner.loop`).

It is started as `python -m nanoserve.engine.tp_worker RANK WORLD PORT STEP_ADDRESS CORES`,
the config as msgpack on stdin (never pickled). The engine core runs in a daemonic
multiprocessing child, which multiprocessing forbids to have children of its own; a plain
subprocess is the same fresh interpreter a spawn context would give. A worker exits on
`WorkerShutdown`, when rank 0 (its parent) is gone, or on any error (a collective whose peer
died raises): rank 0 notices the exit and fails the engine (tp_executor.py).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import sys
import traceback

import msgspec
import torch
import zmq

from nanoserve.config import EngineConfig
from nanoserve.engine.memory import keep_freed_memory_in_heap
from nanoserve.engine.model_runner import ModelRunner, resolve_kv_cache_dtype
from nanoserve.model.loader import load_model
from nanoserve.model.parallel import destroy_group, init_group
from nanoserve.protocol import StepInput, WorkerShutdown, decode_worker_message

_PARENT_CHECK_MS = 500  # how long an idle worker waits for a step before checking rank 0


def split_cores(cores: list[int], world_size: int) -> list[list[int]] | None:
    """Each rank's cores: the usable ones split evenly (one left for the API server when
    there are more than 2, as vLLM reserves one); None when there are fewer than ranks."""
    usable = sorted(cores)[:-1] if len(cores) > 2 else sorted(cores)
    if len(usable) < world_size:
        return None
    share = len(usable) // world_size
    return [usable[r * share : (r + 1) * share] for r in range(world_size)]


def pin_to_cores(cores: list[int] | None) -> None:
    """Run on `cores` with one torch thread each; without cores of its own, one thread."""
    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores) if cores else 1)


class TPWorker:
    """A rank's model runner, driven by the steps rank 0 publishes."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @torch.inference_mode()
    def execute(self, step: StepInput) -> None:
        """The forward and every logits computation rank 0 makes for this step (each gathers
        over the group): the sampled and prompt-logprob rows, then "score" pooling rows."""
        _, _, hidden = self.runner.execute_step(step)
        score_rows = [e.first_row + e.num_rows - 1 for e in step.pooling
                      if e.is_last and e.params.task == "score"]
        if score_rows:  # the rows, in the order rank 0's Pooler asks for them
            self.runner.compute_logits(hidden.index_select(0, torch.tensor(score_rows)))


def run_tp_worker(config: EngineConfig, rank: int, world_size: int, port: int,
                  step_address: str, cores: list[int] | None) -> int:
    """Join the group, load this rank's shard, run steps until told to stop; the exit code."""
    # 1) cores, the group, the shard and the KV cache rank 0 sized
    pin_to_cores(cores)
    keep_freed_memory_in_heap()  # as the engine core does: no page faults on each temporary
    parallel, model = config.parallel, config.model
    group = init_group(rank, world_size, parallel.master_addr, port,
                       timeout_s=parallel.distributed_timeout_s)
    device, dtype = model.torch_device, model.torch_dtype
    loaded = load_model(model.model, device, dtype, model.max_model_len, model.quantization,
                        group)
    num_blocks = group.broadcast_int(0)
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, loaded.quantization,
                                      device, dtype)
    worker = TPWorker(ModelRunner(loaded.model, num_blocks, config.cache.block_size, device,
                                  kv_dtype))
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
            if os.getppid() != parent:  # rank 0 is gone (killed: it cleaned nothing up)
                shutil.rmtree(os.path.dirname(step_address.removeprefix("ipc://")),
                              ignore_errors=True)
                return 1
            continue
        message = decode_worker_message(sock.recv())
        if isinstance(message, WorkerShutdown):
            break
        worker.execute(message)
    sock.close(linger=0)
    context.term()
    destroy_group(group)
    return 0


def main(argv: list[str]) -> None:
    """Process entry point: exits with run_tp_worker's code, or 1 on any error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher
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

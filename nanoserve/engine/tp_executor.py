"""Tensor parallelism on one host, from rank 0's side: the worker processes and the executor.

Rank 0 is the engine core as at one rank (scheduler, prefix cache, sampler, grammars) with its
own shard of the weights and of the KV cache. It starts ranks 1..N-1 (tp_worker.py), joins
their gloo group, and each step publishes the `StepInput` before running its own worker on it,
so every rank runs the same forward and meets the others in its collectives; only rank 0
samples (reference/scale-out.md §1).

The step channel is a ZMQ PUB socket over ipc in a private directory, not the gloo group:
an idle engine sends nothing for as long as it likes, while a gloo receive would time out,
and a worker waiting on ZMQ can notice that rank 0 is gone. PUB drops what it sends before a
subscriber joins, so rank 0 counts every worker's subscription (XPUB, verbose) before its first
step (vLLM's `MessageQueue.wait_until_ready`), and never drops once they have (no high-water
mark: the ranks run in step anyway). Rank 0 checks its workers before each step and whenever
the engine loop asks (`check_health`); a dead one fails the engine (EngineDead in core_proc).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import replace
from typing import Any

import msgspec
import zmq

from nanoserve.config import EngineConfig, SamplerConfig, SchedulerConfig
from nanoserve.engine.tp_worker import pin_to_cores, split_cores
from nanoserve.engine.worker import Worker
from nanoserve.model.loader import load_arch
from nanoserve.model.parallel import (
    TensorParallelGroup,
    destroy_group,
    init_group,
    open_rendezvous,
)
from nanoserve.model.shard import local_arch
from nanoserve.protocol import StepInput, StepOutput, WorkerShutdown, encode

_STOP_WAIT_S = 5.0  # how long a worker gets to leave after WorkerShutdown before it is killed


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker exited while rank 0 still needed it."""


class TensorParallelRanks:
    """Ranks 1..N-1 as rank 0 sees them: their processes, the group, the step publisher."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        self.world_size = world = parallel.tensor_parallel_size
        # what cannot run: the named error now, before any worker starts
        if config.model.torch_device.type != "cpu":
            raise ValueError(f"tensor_parallel_size={world} runs on the CPU (gloo) only so far, "
                             f"not on {config.model.torch_device}; NCCL is not built yet")
        if config.model.zero_cost_runner:
            raise ValueError("the zero-cost engine skips the model: use tensor_parallel_size=1")
        local_arch(load_arch(config.model.model), TensorParallelGroup(0, world))
        self.timeout_s = parallel.distributed_timeout_s
        self.directory = tempfile.mkdtemp(prefix="nanoserve-tp-")
        os.chmod(self.directory, 0o700)  # only this user may publish or read steps
        self.context = zmq.Context()
        self.publisher = self.context.socket(zmq.XPUB)
        self.publisher.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not the first
        self.publisher.setsockopt(zmq.SNDHWM, 0)
        self.publisher.setsockopt(zmq.LINGER, 0)  # steps queued for a dead worker: dropped
        address = f"ipc://{self.directory}/steps"
        self.publisher.bind(address)
        self.store, port = open_rendezvous(parallel.master_addr, self.timeout_s)
        self.cores = split_cores(list(os.sched_getaffinity(0)), world)
        # what the workers need: no scheduler or sampler settings (those may name classes)
        worker_config = msgspec.msgpack.encode(
            replace(config, scheduler=SchedulerConfig(), sampler=SamplerConfig()))
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stop = weakref.finalize(self, _kill, self.procs, self.directory, self.context)
        try:
            for rank in range(1, world):
                cores = ",".join(map(str, self.cores[rank])) if self.cores else ""
                proc = subprocess.Popen(
                    [sys.executable, "-m", "nanoserve.engine.tp_worker", str(rank), str(world),
                     str(port), address, cores], stdin=subprocess.PIPE)
                self.procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(worker_config)
                proc.stdin.close()
            self.group: TensorParallelGroup = init_group(
                0, world, parallel.master_addr, port, store=self.store, timeout_s=self.timeout_s)
        except BaseException:
            self._stop()
            raise

    def pin_rank0(self) -> None:
        """Rank 0 onto its share of the cores (the engine core's own process only: in-process,
        as under `LLM`, the caller's process keeps its affinity)."""
        pin_to_cores(self.cores[0] if self.cores else None)

    def check_alive(self) -> None:
        """Raise WorkerDiedError if any worker has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                                      f"exited with code {code}")

    def wait_ready(self) -> None:
        """Until every worker has subscribed to the steps (none is lost to a late join)."""
        deadline = time.monotonic() + self.timeout_s
        joined = 0
        while joined < self.world_size - 1:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.world_size - 1 - joined} tensor-parallel workers "
                                   f"did not subscribe within {self.timeout_s:g} s")
            if self.publisher.poll(100):
                joined += self.publisher.recv()[:1] == b"\x01"  # a subscription, not a leave

    def publish(self, step: StepInput) -> None:
        self.publisher.send(encode(step))

    def shutdown(self) -> None:
        """Tell the workers to stop and wait for them (killed after a few seconds); leave the
        group only if every one left cleanly (a destroy can hang on a dead peer)."""
        if not self._stop.alive:
            return
        self.publisher.send(encode(WorkerShutdown()))
        deadline = time.monotonic() + _STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        if all(proc.wait() == 0 for proc in self.procs):
            destroy_group(self.group)
        self._stop()


def _kill(procs: list[subprocess.Popen[bytes]], directory: str,
          context: zmq.Context[Any]) -> None:
    """Stop every worker (killed if still running: the last resort, at exit or for an engine
    dropped without shutdown), close the publisher, remove its socket file."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    context.destroy(linger=0)
    shutil.rmtree(directory, ignore_errors=True)


class TPExecutor:
    """Rank 0's executor: publishes each step to the workers, then runs its own worker (the
    forward, gathering the logits, and the sampler) on it."""

    def __init__(self, worker: Worker, ranks: TensorParallelRanks) -> None:
        self.worker = worker
        self.ranks = ranks
        ranks.wait_ready()

    def execute_step(self, step: StepInput) -> StepOutput:
        self.ranks.check_alive()
        self.ranks.publish(step)
        return self.worker.execute(step)

    def check_health(self) -> None:
        self.ranks.check_alive()

    def shutdown(self) -> None:
        self.ranks.shutdown()

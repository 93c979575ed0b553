"""Tensor parallelism from rank 0's side: its node's worker processes and the executor.

Rank 0 is the engine core as at one rank (scheduler, prefix cache, sampler, grammars) with its
own shard of the weights and of the KV cache. It starts its node's other ranks (tp_worker.py;
across nodes the others' launchers start theirs, tp_node.py), joins their gloo group, and
each step publishes the `StepInput` before running its own worker on it, so every rank runs
the same forward and meets the others in its collectives; only rank 0 samples (as vLLM's
driver worker does).

The step channel is a ZMQ PUB socket over ipc in a private directory (across nodes over tcp
on `--master-addr` too, at a port the OS picks, announced in the rendezvous store), not the
gloo group: an idle engine sends nothing for as long as it likes, while a gloo receive would
time out, and a worker waiting on ZMQ can notice that rank 0 is gone. PUB drops what it sends
before a subscriber joins, so rank 0 counts every rank's subscription, local or remote (XPUB,
verbose), before its first step (vLLM's `MessageQueue.wait_until_ready`), and never drops once
they have (no high-water mark: the ranks run in step anyway). Rank 0 checks its workers before
each step and whenever the engine loop asks (`check_health`): its own by their exit, another
node's by its subscription closing (XPUB_VERBOSER reports every leave); a dead one fails the
engine (EngineDead in core_proc).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import weakref
from typing import Any

import zmq

from nanoserve.config import EngineConfig
from nanoserve.engine.cores import pin_to_cores, split_cores
from nanoserve.engine.tp_worker import STEP_ADDRESS_KEY, start_worker, worker_config_bytes
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
        if parallel.headless:
            raise ValueError("a --headless node runs no engine core, only its ranks: start it "
                             "with `nanoserve serve ... --headless`")
        if config.model.zero_cost_runner:
            raise ValueError("the zero-cost engine skips the model: use tensor_parallel_size=1")
        local_arch(load_arch(config.model.model), TensorParallelGroup(0, world))
        self.timeout_s = parallel.distributed_timeout_s
        self.directory = tempfile.mkdtemp(prefix="nanoserve-tp-")
        os.chmod(self.directory, 0o700)  # only this user may publish or read steps
        self.context = zmq.Context()
        self.publisher = self.context.socket(zmq.XPUB)
        # every subscription, not the first, and every leave (a rank on another node gone)
        self.publisher.setsockopt(zmq.XPUB_VERBOSER, 1)
        self.publisher.setsockopt(zmq.SNDHWM, 0)
        self.publisher.setsockopt(zmq.LINGER, 0)  # steps queued for a dead worker: dropped
        self.is_ready = False  # until every rank has subscribed (wait_ready)
        address = f"ipc://{self.directory}/steps"
        self.publisher.bind(address)
        self.store, port = open_rendezvous(parallel.master_addr, self.timeout_s,
                                           parallel.master_port)
        if parallel.nnodes > 1:  # the other nodes' ranks read where to subscribe in the store
            tcp_port = self.publisher.bind_to_random_port(f"tcp://{parallel.master_addr}")
            self.store.set(STEP_ADDRESS_KEY, f"tcp://{parallel.master_addr}:{tcp_port}")
        self.cores = split_cores(list(os.sched_getaffinity(0)), parallel.num_local_ranks)
        worker_config = worker_config_bytes(config)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._stop = weakref.finalize(self, _kill, self.procs, self.directory, self.context)
        try:
            for rank in range(1, parallel.num_local_ranks):  # this node's; the others start theirs
                self.procs.append(start_worker(worker_config, rank, world, port, address,
                                               self.cores[rank] if self.cores else None))
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
        """Raise WorkerDiedError if any worker has exited or, once all have subscribed, any
        rank's subscription has closed (the only sign a rank on another node gives)."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                                      f"exited with code {code}")
        if self.is_ready and self.publisher.poll(0) and self.publisher.recv()[:1] == b"\x00":
            raise WorkerDiedError("a tensor-parallel rank's step subscription closed (a rank "
                                  "on another node is gone)")

    def wait_ready(self) -> None:
        """Until every rank, on this node or another, has subscribed to the steps (none is
        lost to a late join)."""
        deadline = time.monotonic() + self.timeout_s
        joined = 0
        while joined < self.world_size - 1:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.world_size - 1 - joined} tensor-parallel workers "
                                   f"did not subscribe within {self.timeout_s:g} s")
            if self.publisher.poll(100):
                joined += self.publisher.recv()[:1] == b"\x01"  # a subscription, not a leave
        self.is_ready = True

    def publish(self, step: StepInput) -> None:
        self.publisher.send(encode(step))

    def shutdown(self) -> None:
        """Tell the workers to stop and wait for them (killed after a few seconds); leave the
        group only if every one left cleanly (a destroy can hang on a dead peer)."""
        if not self._stop.alive:
            return
        self.publisher.send(encode(WorkerShutdown()))
        self.publisher.close(linger=1000)  # other nodes' ranks get it over tcp, not at once
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

    @property
    def local_worker(self) -> Worker:
        return self.worker

    def pin_cores(self) -> None:
        self.ranks.pin_rank0()  # the cores were split before the workers started

    def execute_step(self, step: StepInput) -> StepOutput:
        self.ranks.check_alive()
        self.ranks.publish(step)
        return self.worker.execute(step)

    def check_health(self) -> None:
        self.ranks.check_alive()

    def shutdown(self) -> None:
        self.ranks.shutdown()

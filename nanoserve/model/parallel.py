"""The tensor-parallel group a model's layers reduce their partial results over.

Under tensor parallelism (issue 23) each rank holds a slice of every projection: the attention
output projection and the MLP down projection then each give a partial sum that every rank
must add up (one all-reduce after each, Megatron's layout), and the LM head gives each rank
a slice of the vocabulary's logits, gathered to rank 0 only (the only rank that samples,
as nano-vllm's `ParallelLMHead`). At one rank, the only case without workers, the group is
the identity and returns its argument (a Python call, ~50 ns: no copy, no op).

Several ranks talk over torch.distributed's gloo backend on the CPU. On one node rank 0 opens
the rendezvous store on a port the OS picks (port 0), so no fixed port can collide (nano-vllm's
2333 does) and no port is picked, closed and bound again by someone else in between; across
nodes it listens on the `--master-port` the other nodes were told. Gloo's
own connections stay on loopback when the ranks meet there; else they use the interface
GLOO_SOCKET_IFNAME names (read by torch's constructor: one concrete interface, not NCCL's `^lo`
syntax), or the address the hostname resolves to.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0  # a collective that waits longer has lost a rank (mini-sglang's)


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """This process's rank among `world_size` ranks that split the model's weights; with
    more than one, `process_group` is the torch.distributed group they reduce over."""

    rank: int = 0
    world_size: int = 1
    process_group: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` [..] over the group's ranks, in place; `x` itself, unchanged, at one
        rank."""
        if self.world_size == 1:
            return x
        self.process_group.allreduce([x]).wait()
        return x

    def gather_to_rank0(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [rows, n] joined on the last dimension, [rows, world_size * n],
        on rank 0; on the other ranks `x` itself (they sample nothing). `x` at one rank."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self.process_group.gather([], [x], options).wait()
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.process_group.gather([parts], [x], options).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank (the KV cache's block count: rank 0 sizes it)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self.process_group.broadcast(t, 0).wait()
        return int(t.item())


def open_rendezvous(host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S,
                    port: int | None = None) -> tuple[dist.TCPStore, int]:
    """Rank 0's rendezvous store, listening on `port` (across nodes, where the others look for
    it) or on a free port the OS picked; (store, its port)."""
    store = dist.TCPStore(host, port or 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, store.port


def connect_rendezvous(host: str, port: int,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """A rank's connection to rank 0's store (retried until rank 0 listens, up to
    `timeout_s`)."""
    return dist.TCPStore(host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def init_group(rank: int, world_size: int, host: str, port: int,
               store: dist.TCPStore | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> TensorParallelGroup:
    """Join the gloo group of `world_size` ranks that meet at tcp://host:port (rank 0 passes
    the store it opened); returns once every rank has joined, or raises after `timeout_s`.

    The group is a gloo process group of its own, not torch.distributed's default one: a
    process holds one default group at most, and one process may run several engines (tests,
    `LLM` objects one after another, data-parallel replicas later)."""
    if world_size == 1:
        return TensorParallelGroup()
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = connect_rendezvous(host, port, timeout_s)
    if not _is_loopback(host):
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        return TensorParallelGroup(rank, world_size, group)
    # one host: gloo's connections on loopback too, not on whatever address the hostname
    # resolves to (its traffic is neither encrypted nor authenticated)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (as torch uses it)
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return TensorParallelGroup(rank, world_size,
                               dist.ProcessGroupGloo(store, rank, world_size, options))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def destroy_group(group: TensorParallelGroup) -> None:
    """Leave the group cleanly: only when every rank shuts down together (on an error path a
    process exits instead, torchtitan PR #1342: a shutdown can hang on a dead peer)."""
    if not group.is_single:
        group.process_group.shutdown()

"""A decode step's floor on this machine: what reading its bytes or doing its multiply-adds
takes at the rates measured here, whichever is longer.

  bytes  every matmul weight as the kernels hold it (packed blocks; a 4-bit weight's wide form
         where the kernel reads it, from 16 rows on), the LM head, and each request's KV cache
         rows up to its context, read once per step. A MoE layer's experts count only as
         many as the step's tokens choose: k at one token, and for B tokens the number of
         distinct experts B tokens drawing k of E each would hit if the router spread them
         evenly, E (1 - (1 - k/E)^B); its router and shared expert always
  read   the read bandwidth the step can have: a sum over a buffer the size of one
         request's step (its weights), repeated as the steps repeat, 2 threads (the best of a
         few). Where the caches hold the weights between steps (a server CPU's L3 of hundreds
         of MB), that is the caches' rate, not DRAM's: a floor at DRAM's rate would be one the
         step can beat
  MACs   the projections' and the LM head's multiply-adds for the step's rows (attention's are
         counted as bytes: at these sizes it waits on the cache rows, not on arithmetic); a
         MoE layer's, each row's k experts, its router and shared expert
  rate   the int8 matmul kernel's multiply-adds per second on the model's largest projection
         at 256 rows (the best of a few), where the kernel is bound by arithmetic

floor = max(bytes / read, MACs / rate); `bench step` prints each step beside it. Beside it
too, the floor as the kernel sees it: the bytes over the rate the quantized matmul itself reads
the step's weights at one row (its prefetch and schedule included: kernel_tuning/), measured
in the same run. Both read rates are sampled between the steps being timed (`ReadProbe`), so
a machine whose rate drifts (a neighbour's load, a cloud host's) moves them together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from nanoserve.bench.timing import best_seconds
from nanoserve.kernel_tuning.schedule import running_schedule
from nanoserve.model.llama import CausalLM
from nanoserve.model.quant_linear import QuantizedWeight
from nanoserve.model.quantization import ConcatWeight

_MIN_READ_BYTES = 64 << 20  # a tiny model's step would measure L2's rate, not a stream's


@dataclass(frozen=True)
class MachineRates:
    read_bytes_per_s: float
    macs_per_s: float  # the quantized kernel's (or oneDNN's, for float weights)
    read_buffer_bytes: int = 0  # the buffer the read rate was measured on
    kernel_read_bytes_per_s: float = 0.0  # the matmul's own read of the weights at one row


@dataclass(frozen=True)
class StepFloor:
    bytes_read: float
    macs: float
    rates: MachineRates

    @property
    def memory_seconds(self) -> float:
        return self.bytes_read / self.rates.read_bytes_per_s

    @property
    def kernel_memory_seconds(self) -> float:
        """The bytes at the kernel's own read rate (0 where it was not measured)."""
        rate = self.rates.kernel_read_bytes_per_s
        return self.bytes_read / rate if rate else 0.0

    @property
    def compute_seconds(self) -> float:
        return self.macs / self.rates.macs_per_s

    @property
    def seconds(self) -> float:
        return max(self.memory_seconds, self.compute_seconds)


def matmul_weights(model: CausalLM) -> list[Any]:
    """Every weight a step reads whole: the projections and the LM head, not the experts."""
    weights = [w for layer in model.decoder_layers
               for w in (getattr(layer, attr) for attr in layer.MATMUL_WEIGHTS)
               if w is not None]  # (a MoE layer has no gate_up nor down: `_expert_reads`)
    return [*weights, model.lm_head]


def _expert_reads(model: CausalLM, batch: int) -> tuple[float, float]:
    """(bytes, multiply-adds) of the MoE layers' routers and experts in a step of `batch`
    rows: the experts they choose (see the top), and the shared expert."""
    num_bytes = macs = 0.0
    for layer in model.decoder_layers:
        if layer.moe is None:
            continue
        router, experts = layer.moe.gate, layer.moe.experts
        top_k, num_experts = layer.moe.num_experts_per_tok, len(experts)
        hit = num_experts * (1 - (1 - top_k / num_experts) ** batch)
        rows = round(batch * top_k / hit)  # an expert's rows, on average
        expert = [experts[0].gate_up_proj, experts[0].down_proj]
        num_bytes += hit * sum(_weight_bytes(w, rows) for w in expert) + _weight_bytes(router, 1)
        macs += batch * (top_k * sum(n * k for n, k in map(weight_shape, expert))
                         + router.shape[0] * router.shape[1])
        if layer.moe.shared_expert is not None:
            shared = [layer.moe.shared_expert.gate_up_proj, layer.moe.shared_expert.down_proj]
            num_bytes += sum(_weight_bytes(w, batch) for w in shared)
            macs += batch * sum(n * k for n, k in map(weight_shape, shared))
    return num_bytes, macs


def weight_shape(weight: Any) -> tuple[int, int]:
    return tuple(weight.shape)


def _weight_bytes(weight: Any, rows: int) -> int:
    if isinstance(weight, QuantizedWeight):
        # the kernel reads a 4-bit weight's wide form from the schedule's threshold on
        if rows >= running_schedule().wide_min_rows and weight.wide is not None:
            return weight.wide.numel()
        return weight.data.numel() * weight.data.element_size()
    if isinstance(weight, ConcatWeight):  # a GGUF file's q, k and v in different types
        return sum(_weight_bytes(part, rows) for part in weight.parts)
    return weight.numel() * weight.element_size()


def step_floor(model: CausalLM, kv_cache: torch.Tensor, batch: int, context_len: int,
               rates: MachineRates) -> StepFloor:
    """The floor of one decode step of `batch` requests at `context_len` tokens of context;
    `kv_cache` is one layer's key cache [Hkv, num_blocks, block_size, row] (its row bytes)."""
    weights = matmul_weights(model)
    expert_bytes, expert_macs = _expert_reads(model, batch)
    weight_bytes = sum(_weight_bytes(w, batch) for w in weights) + expert_bytes
    row_bytes = kv_cache.shape[-1] * kv_cache.element_size()
    arch = model.arch
    attention_layers = len(arch.attention_layers)
    cache_bytes = batch * context_len * attention_layers * 2 * arch.num_kv_heads * row_bytes
    if arch.linear is not None:  # a hybrid's DeltaNet states: each read and written once
        cache_bytes += batch * 2 * 4 * arch.linear.state_floats * len(arch.linear_layers)
    macs = batch * sum(n * k for n, k in map(weight_shape, weights)) + expert_macs
    return StepFloor(weight_bytes + cache_bytes, macs, rates)


def measure_rates(model: CausalLM, repeats: int = 5) -> MachineRates:
    """The read bandwidth and the matmul kernel's multiply-add rate, measured now."""
    probe = ReadProbe(model)
    for _ in range(repeats):
        probe.sample()
    return probe.rates(macs_per_s(model, repeats))


def macs_per_s(model: CausalLM, repeats: int = 5) -> float:
    """The matmul kernel's multiply-adds per second on the model's largest projection at 256
    rows (the best of `repeats`), where it is bound by arithmetic."""
    layer = model.decoder_layers[-1]  # its MLP's gate/up, or its first expert's
    largest: Any = (layer.gate_up_proj if layer.moe is None
                    else layer.moe.experts[0].gate_up_proj)
    rows, (num_rows, in_features) = 256, weight_shape(largest)
    x = torch.randn(rows, in_features)
    matmul = largest.matmul if isinstance(largest, QuantizedWeight) else (lambda a: a @ largest.T)
    return rows * num_rows * in_features / best_seconds(lambda: matmul(x), repeats)


class ReadProbe:
    """The two read rates, one sample of each per `sample()` call (between the steps a
    benchmark times): a sum over a buffer of the step's weight bytes, and the quantized
    matmul's own one-row pass over the model's packed weights (none for float weights)."""

    def __init__(self, model: CausalLM) -> None:
        from nanoserve.kernel_tuning.workloads import step_weights

        one_row = (sum(_weight_bytes(w, 1) for w in matmul_weights(model))
                   + _expert_reads(model, 1)[0])
        self.buffer_bytes = max(_MIN_READ_BYTES, int(one_row))
        self._buffer = torch.ones(self.buffer_bytes // 4, dtype=torch.float32)  # faulted in
        weights = step_weights(model)
        self._kernel_bytes = weights.num_bytes
        self._sweep = weights.sweep(1) if weights.weights else None
        self._sums: list[float] = []
        self._sweeps: list[float] = []
        self._buffer.sum()
        if self._sweep is not None:
            self._sweep()

    def sample(self) -> None:
        self._sums.append(_seconds(self._buffer.sum))
        if self._sweep is not None:
            self._sweeps.append(_seconds(self._sweep))

    def rates(self, macs: float) -> MachineRates:
        """The read rates at the best of the samples, and `macs` (multiply-adds a second)."""
        kernel = self._kernel_bytes / min(self._sweeps) if self._sweeps else 0.0
        return MachineRates(self.buffer_bytes / min(self._sums), macs, self.buffer_bytes,
                            kernel)


def _seconds(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def format_floors(steps: list[tuple[int, float, StepFloor]], rates: MachineRates) -> str:
    """(batch, measured step seconds, floor) rows as a table."""
    kernel = (f"; the matmul kernel's own one-row read of the weights: "
              f"{rates.kernel_read_bytes_per_s / 1e9:.1f} GB/s (the kernel's floor)"
              if rates.kernel_read_bytes_per_s else "")
    lines = [f"floor: max(bytes / {rates.read_bytes_per_s / 1e9:.1f} GB/s read (a sum over "
             f"{rates.read_buffer_bytes / 1e6:.0f} MB, the step's weights, again and again), "
             f"multiply-adds / {rates.macs_per_s / 1e9:.0f} GMAC/s of the matmul kernel), "
             f"both measured now{kernel}",
             "| batch | step | bytes | memory floor | kernel's floor | multiply-adds | "
             "compute floor | step / floor | step / kernel's floor |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, seconds, floor in steps:
        kernel_floor = max(floor.kernel_memory_seconds, floor.compute_seconds)
        versus_kernel = f"{seconds / kernel_floor:.2f}x" if floor.kernel_memory_seconds else ""
        lines.append(f"| {batch} | {seconds * 1e3:.1f} ms | {floor.bytes_read / 1e6:.0f} MB | "
                     f"{floor.memory_seconds * 1e3:.2f} ms | "
                     f"{floor.kernel_memory_seconds * 1e3:.2f} ms | {floor.macs / 1e9:.2f} G | "
                     f"{floor.compute_seconds * 1e3:.2f} ms | "
                     f"{seconds / floor.seconds:.2f}x | {versus_kernel} |")
    return "\n".join(lines)

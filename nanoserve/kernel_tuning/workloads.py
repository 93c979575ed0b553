"""What the tuner times: the loaded model's own work, as a decode step does it.

- `StepWeights`: the model's packed weights, swept in a step's order at a number of
  activation rows, as a step reads them: at one row, gigabytes of a larger model stream from
  DRAM, and the prefetch decides how fast.
- `AttentionWork`: decode attention over every layer's cache at one long context and at
  batches of short ones, on synthetic caches of the model's shape and the cache's dtype, with their
  blocks scattered as a paged cache's are.
- `DeltaNetWork` (hybrid models): Gated DeltaNet's mixer over every DeltaNet layer's states, a
  batch of decodes and a prefill chunk, on synthetic states of the model's shape and the
  pool's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanoserve.kernel_tuning.schedule import LAYOUT_OF_TYPE, TYPE_NAMES
from nanoserve.model.llama import CausalLM
from nanoserve.model.quant_linear import QuantizedWeight

LONG_CONTEXT = 4096
SHORT_CONTEXT, SHORT_BATCH = 512, 8
BATCHED_CONTEXT, BATCHED_BATCH = 128, 32  # (each sweep reads 4,096 tokens' rows)
# (batch, context) of the attention classes' sweeps: the prefetch hint's, the walk step's
HINT_SWEEPS = ((1, LONG_CONTEXT), (SHORT_BATCH, SHORT_CONTEXT))
BLOCK_SWEEPS = (*HINT_SWEEPS, (BATCHED_BATCH, BATCHED_CONTEXT))
# (sequences, tokens each) of the DeltaNet strips' sweeps: 8 decodes over every DeltaNet layer
# (each layer's states of 8 sequences, 8 MB on Qwen3.5-0.8B, meet the caches as a step leaves
# them), then one 128-token prefill chunk over two layers (the strip sits in L1 through it)
STRIP_SWEEPS = ((8, 1, None), (1, 128, 2))


@dataclass
class StepWeights:
    """The model's packed weights in the order a decode step reads them: every layer's
    projections, then the LM head (a MoE layer's experts are read per token, and left out).
    The tuner times a candidate for one layout on the whole sweep, so each weight meets the
    caches as a step leaves them (an LM head swept alone would sit in L3)."""

    weights: list[QuantizedWeight] = field(default_factory=list)

    @property
    def layouts(self) -> list[str]:
        return list(dict.fromkeys(LAYOUT_OF_TYPE[w.ggml_type] for w in self.weights))

    def type_names(self, layout: str) -> str:
        return "/".join(sorted({TYPE_NAMES[w.ggml_type] for w in self.weights
                                if LAYOUT_OF_TYPE[w.ggml_type] == layout}))

    @property
    def num_bytes(self) -> int:
        """The packed bytes one sweep reads (the narrow form)."""
        return sum(w.data.numel() for w in self.weights)

    def macs(self, rows: int) -> int:
        return rows * sum(w.shape[0] * w.shape[1] for w in self.weights)

    def sweep(self, rows: int, module: Any = None) -> Callable[[], None]:
        """One pass over the weights at `rows` activation rows: through each weight's own
        `matmul` (the process's tier), or `module`'s packed_matmul (a tier's module)."""
        inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in self.weights}}
        calls = [(w, inputs[w.shape[1]]) for w in self.weights]

        def run() -> None:
            for weight, x in calls:
                if module is None:
                    weight.matmul(x)
                else:
                    module.packed_matmul(x, *weight.packed_args())
        return run


def step_weights(model: CausalLM) -> StepWeights:
    """See `StepWeights`."""
    step = StepWeights()
    for layer in model.decoder_layers:
        for attr in layer.MATMUL_WEIGHTS:
            _add(step, getattr(layer, attr))
    _add(step, model.lm_head)
    return step


def _add(step: StepWeights, weight: Any) -> None:
    if isinstance(weight, QuantizedWeight) and weight.is_packed:
        step.weights.append(weight)


@dataclass
class AttentionWork:
    """Decode attention over synthetic caches of the model's shape (see the module), made at
    the first sweep: a start that reads its choice from the cache allocates nothing."""

    module: Any  # the paged_attention kernels
    cache_shape: tuple[int, int, int, int]  # one layer's [Hkv, blocks, block_size, row]
    dtype: torch.dtype
    num_layers: int
    num_heads: int
    head_dim: int
    _caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def name(self) -> str:
        kv_heads = self.cache_shape[0]
        return f"attention {str(self.dtype).removeprefix('torch.')} {kv_heads}x{self.head_dim}"

    @property
    def num_bytes(self) -> int:
        """Every layer's keys and values."""
        return 2 * self.num_layers * math.prod(self.cache_shape) * self.dtype.itemsize

    def sweep(self, batch: int, context: int) -> Callable[[], None]:
        """Every layer's attention for `batch` requests of `context` tokens each."""
        if not self._caches:
            self._caches = [(torch.zeros(self.cache_shape, dtype=self.dtype),
                             torch.zeros(self.cache_shape, dtype=self.dtype))
                            for _ in range(self.num_layers)]
        blocks = _blocks(context, self.cache_shape[2])
        order = torch.randperm(self.cache_shape[1], generator=torch.Generator()
                               .manual_seed(0))[: batch * blocks]
        table = order.to(torch.int32).reshape(batch, blocks)
        lens = torch.full((batch,), context, dtype=torch.int32)
        q = torch.randn(batch, self.num_heads, self.head_dim)
        out = torch.empty_like(q)
        scale = self.head_dim ** -0.5

        def run() -> None:
            for k, v in self._caches:
                self.module.decode_attention(q, k, v, table, lens, scale, out)
        return run


def attention_work(runner: Any, model: CausalLM) -> AttentionWork | None:
    """The workload for the runner's attention, where it is the CPU kernel (else None)."""
    from nanoserve.model.attention.cpu_paged import CpuPagedBackend
    from nanoserve.native import load_kernels

    if not isinstance(runner.attention, CpuPagedBackend):
        return None
    module = load_kernels("paged_attention")
    if module is None:
        return None
    k_cache = runner.kv_caches[0][0]  # [Hkv, blocks, block_size, row]
    num_kv_heads, _, block_size, row = k_cache.shape
    blocks = max(batch * _blocks(context, block_size) for batch, context in BLOCK_SWEEPS)
    return AttentionWork(module, (num_kv_heads, blocks, block_size, row), k_cache.dtype,
                         len(model.decoder_layers), model.arch.num_heads, model.arch.head_dim)


@dataclass
class DeltaNetWork:
    """Gated DeltaNet's mixer (`delta_net_ops.delta_rule`'s kernel) on synthetic inputs of the
    model's shape, its states zeroed and of the pool's dtype (made by `sweep`, before the
    timing)."""

    module: Any  # the delta_net kernels
    shape: Any  # the model's LinearAttentionConfig
    num_layers: int
    ssm_dtype: torch.dtype

    @property
    def name(self) -> str:
        s = self.shape
        return (f"delta net strips {str(self.ssm_dtype).removeprefix('torch.')} "
                f"{s.num_value_heads}x{s.key_head_dim}x{s.value_head_dim}")

    def num_bytes(self, sequences: int, layers: int) -> int:
        """The recurrent states a sweep reads (and writes)."""
        s = self.shape
        return (sequences * layers * s.num_value_heads * s.key_head_dim * s.value_head_dim
                * self.ssm_dtype.itemsize)

    def sweep(self, sequences: int, tokens: int, layers: int | None) -> Callable[[], None]:
        """`layers` (None: all) layers' mixer for `sequences` sequences of `tokens` each."""
        s, count = self.shape, layers or self.num_layers
        gen = torch.Generator().manual_seed(0)
        rows, heads = sequences * tokens, s.num_value_heads
        qkv, a, b = (torch.randn(rows, width, generator=gen)
                     for width in (s.conv_dim, heads, heads))
        conv_weight = torch.randn(s.conv_dim, s.conv_kernel, generator=gen) * 0.5
        neg_exp_a, dt_bias = -torch.rand(heads, generator=gen), torch.zeros(heads)
        conv = torch.zeros(sequences, count, s.conv_dim, s.conv_kernel - 1)
        ssm = torch.zeros(sequences, count, heads, s.key_head_dim, s.value_head_dim,
                          dtype=self.ssm_dtype)
        slots = torch.arange(sequences, dtype=torch.int32)
        starts = torch.arange(0, rows + 1, tokens, dtype=torch.int32)
        snapshots = torch.full((rows,), -1, dtype=torch.int32)

        def run() -> None:
            for layer in range(count):
                self.module.delta_rule(qkv, a, b, conv_weight, neg_exp_a, dt_bias, conv, ssm,
                                       layer, slots, starts, snapshots, s.num_key_heads,
                                       s.v_heads_tiled)
        return run


def delta_net_work(runner: Any, model: CausalLM) -> DeltaNetWork | None:
    """The workload of a hybrid model's DeltaNet layers where the C++ kernel runs them (else
    None)."""
    from nanoserve.model.delta_net_ops import fits_kernel, kernels

    shape, pool = model.arch.linear, getattr(runner, "state_pool", None)
    if shape is None or pool is None or not fits_kernel(shape):
        return None
    module = kernels()
    if module is None:
        return None
    return DeltaNetWork(module, shape, len(model.arch.linear_layers), pool.ssm.dtype)


def _blocks(context: int, block_size: int) -> int:
    """The cache blocks a context of `context` tokens takes."""
    return -(-context // block_size)


def l3_bytes() -> int | None:
    """The last-level cache's size, from sysfs (None where it does not say)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            level = int((index / "level").read_text())
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append((level, int(digits) * scale))
    return max(sizes)[1] if sizes else None

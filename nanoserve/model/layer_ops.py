"""The two op tables a decoder layer runs on: exact PyTorch ops, or the fused C++ kernels.

llama.py's `BoundDecoderLayer.forward` is the one layer forward; it calls only what a table
binds, with the same signatures in both (chosen once per model, `CausalLM._can_fuse`):

  EXACT_OPS       plain PyTorch: the path held equal to transformers (`--quantization none`,
                  CUDA, any dtype), the reference the fused kernels are tested against
  fused_table()   fused_ops.py's kernels and the quantized matmuls bound to their weights
                  (quantized weights on the CPU in float32)

Both fold a residual add into the norm after it (`add_rms_norm`: hidden += delta in place, then
the norm). In the exact table that is the same add and the same `F.rms_norm` an unfolded layer
runs, so its arithmetic is today's to the bit. Everything a table binds is a callable made once
per model (weights inside): the hot loop looks nothing up and dispatches nothing per op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from nanoserve.model.attention import write_kv_cache
from nanoserve.model.fused_ops import FusedOps, Matmul, bind_matmul, fused_ops
from nanoserve.model.layer_weights import LayerWeights
from nanoserve.model.linear import linear
from nanoserve.model.rope import RotaryEmbedding, apply_rope


class Attend(Protocol):
    """An attention backend's forward (attention/base.py's `AttentionBackend.forward`, which
    states the contract): q [T, H, D], k and v [T, Hkv, D] -> [T, H * D]; `sinks` [H] float32:
    each query head's attention-sink logit (gpt-oss), joined once per query, or None."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                 stored: bool = False, window: int = 0, *,
                 sinks: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class StepContext:
    """What every layer reads in one step, built once per forward."""

    positions: torch.Tensor  # [T] int64
    # EXACT_OPS: the rows of this step's positions, [T, 1, D] each; fused: the whole tables,
    # [max_positions, D], which rope_store reads by position itself
    cos: torch.Tensor
    sin: torch.Tensor
    attend: Attend
    meta: Any  # the attention backend's metadata, passed through to `attend`
    cache_index: torch.Tensor  # [T] int64, where each token's keys and values are written
    reads_new_kv: bool  # whether `attend` reads this step's k and v, not only the cache
    eps: float
    states: Any = None  # a hybrid model's DeltaNet states (hybrid_layers.py: HybridStates)
    # what one layer leaves for later ones in this step, shared by the KV groups' contexts
    # (Gemma 4: the per-layer inputs, a KV source layer's keys and values)
    scratch: dict[Any, Any] = field(default_factory=dict)


# (qkv [T, (H + 2 * Hkv) * D], step, k_cache, v_cache) -> q [T, H, D] and k, v [T, Hkv, D]
# (None where attention will not read them), k and v written into the caches
RopeStore = Callable[[torch.Tensor, StepContext, torch.Tensor, torch.Tensor],
                     tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


@dataclass(frozen=True, slots=True)
class LayerCalls:
    """One layer's calls with its weights bound in."""

    qkv: Matmul  # [T, hidden] -> [T, (H + 2 * Hkv) * D]
    rope_store: RopeStore
    o: Matmul  # [T, H * D] -> [T, hidden]
    gate_up: Matmul  # [T, hidden] -> [T, 2 * intermediate]
    down: Matmul  # [T, intermediate] -> [T, hidden]


def _gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
                    ) -> torch.Tensor:
    """A Gated DeltaNet's output norm: x, z [T, H * D]; each head of D = weight's size
    RMS-normed with `weight`, then * silu(z) (transformers' Qwen3_5RMSNormGated)."""
    dim = weight.shape[0]
    normed = F.rms_norm(x.reshape(-1, dim), (dim,), weight, eps) * F.silu(z.reshape(-1, dim))
    return normed.view(x.shape)


def _sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's attention output gate: x * sigmoid(gate), both [T, N]."""
    return x * torch.sigmoid(gate)


@dataclass(frozen=True)
class OpTable:
    """The calls every layer shares, and how one layer's weights are bound."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # [T, N] -> [T, N]
    # (hidden, delta, weight, eps): hidden += delta in place, then its norm [T, N]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]  # gate_up [T, 2 * I] -> [T, I]
    gelu_tanh_mul: Callable[[torch.Tensor], torch.Tensor]  # the same with GELU-tanh (Gemma)
    rope_tables: Callable[[RotaryEmbedding, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    bind: Callable[[LayerWeights], LayerCalls]
    is_fused: bool
    # one matmul weight -> its call, as `bind` makes them (a MoE layer's experts: moe.py)
    bind_matmul: Callable[[Any], Matmul] = bind_matmul
    # a hybrid's gates (Qwen3.5): (x, z, weight, eps) -> [T, H * D], (x, gate) -> [T, N]
    gated_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                             torch.Tensor] = _gated_rms_norm
    sigmoid_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _sigmoid_mul


# -- exact: plain PyTorch ---------------------------------------------------------------------
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    hidden.add_(delta)  # the residual add, the same one `hidden + delta` makes
    return F.rms_norm(hidden, (hidden.shape[-1],), weight, eps)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gate: transformers' gelu_pytorch_tanh, the same op."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _exact_rope_store(qkv: torch.Tensor, step: StepContext, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                      head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k norm (Qwen3), RoPE, and the cache write, as the fused rope_store does them."""
    num_tokens = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qk_size = q_size + kv_size
    v = qkv[:, qk_size:].view(num_tokens, num_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q, k = qkv[:, :qk_size].split([q_size, kv_size], dim=-1)
        q = F.rms_norm(q.view(num_tokens, num_heads, head_dim), (head_dim,), q_norm, step.eps)
        k = F.rms_norm(k.view(num_tokens, num_kv_heads, head_dim), (head_dim,), k_norm,
                       step.eps)
        q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
    else:
        # q and k sit side by side in qkv: one rotation of [T, H + Hkv, D] costs half the
        # dispatches of two (each element's arithmetic is the same)
        qk = apply_rope(qkv[:, :qk_size].view(num_tokens, -1, head_dim), step.cos, step.sin)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
    write_kv_cache(k, v, k_cache, v_cache, step.cache_index)
    return q, k, v


def _bind_exact(layer: LayerWeights) -> LayerCalls:
    arch = layer.arch
    rope_store = functools.partial(
        _exact_rope_store, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, q_norm=layer.q_norm, k_norm=layer.k_norm)
    return LayerCalls(qkv=functools.partial(linear, weight=layer.qkv_proj, bias=layer.qkv_bias),
                      rope_store=rope_store,
                      o=functools.partial(linear, weight=layer.o_proj),
                      gate_up=functools.partial(linear, weight=layer.gate_up_proj),
                      down=functools.partial(linear, weight=layer.down_proj))


def _exact_rope_tables(rotary: RotaryEmbedding, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary.lookup(positions)  # [T, 1, D] each, shared by all layers


def _bind_exact_matmul(weight: Any) -> Matmul:
    return functools.partial(linear, weight=weight)


EXACT_OPS = OpTable(rms_norm=_rms_norm, add_rms_norm=_add_rms_norm, silu_mul=_silu_mul,
                    gelu_tanh_mul=_gelu_tanh_mul, rope_tables=_exact_rope_tables,
                    bind=_bind_exact, is_fused=False, bind_matmul=_bind_exact_matmul)


# -- fused: the C++ kernels -------------------------------------------------------------------
def _bind_fused_rope_store(kernel: Callable[..., torch.Tensor], layer: LayerWeights
                           ) -> RopeStore:
    """The kernel's rope_store for this layer: bias (Qwen2), q/k norm (Qwen3), RoPE by
    position from the tables, the cache write; k and v stay in qkv's columns."""
    bias, q_norm, k_norm = layer.qkv_bias, layer.q_norm, layer.k_norm
    q_size, head_dim = layer.arch.q_size, layer.arch.head_dim
    kv_end = q_size + layer.arch.kv_size

    def rope_store(qkv: torch.Tensor, step: StepContext, k_cache: torch.Tensor,
                   v_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        q = kernel(qkv, bias, q_norm, k_norm, step.eps, step.cos, step.sin, step.positions,
                   k_cache, v_cache, step.cache_index)  # [T, H, D]
        if not step.reads_new_kv:  # the two views cost ~7 us a layer (measured)
            return q, None, None
        num_tokens = qkv.shape[0]
        return (q, qkv[:, q_size:kv_end].view(num_tokens, -1, head_dim),
                qkv[:, kv_end:].view(num_tokens, -1, head_dim))

    return rope_store


def _bind_fused(layer: LayerWeights, kernels: FusedOps) -> LayerCalls:
    profiled = kernels.is_profiled
    return LayerCalls(qkv=bind_matmul(layer.qkv_proj, profiled),  # its bias goes to rope_store
                      rope_store=_bind_fused_rope_store(kernels.rope_store, layer),
                      o=bind_matmul(layer.o_proj, profiled),
                      gate_up=bind_matmul(layer.gate_up_proj, profiled),
                      down=bind_matmul(layer.down_proj, profiled))


def _fused_rope_tables(rotary: RotaryEmbedding, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary.cos_table, rotary.sin_table  # rope_store reads the rows itself


@functools.cache
def fused_table(profiled: bool = False) -> OpTable:
    """The kernels' table, each call inside a profiler scope when `profiled` (`bench step`)."""
    kernels = fused_ops(profiled)
    return OpTable(rms_norm=kernels.rms_norm, add_rms_norm=kernels.add_rms_norm,
                   silu_mul=kernels.silu_mul, gelu_tanh_mul=kernels.gelu_tanh_mul,
                   rope_tables=_fused_rope_tables,
                   bind=functools.partial(_bind_fused, kernels=kernels), is_fused=True,
                   bind_matmul=functools.partial(bind_matmul, profiled=profiled),
                   gated_rms_norm=kernels.gated_rms_norm, sigmoid_mul=kernels.sigmoid_mul)

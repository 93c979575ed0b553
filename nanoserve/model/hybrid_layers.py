"""A hybrid model's Gated DeltaNet layer (Qwen3.5/3.6): weights and its one forward.

The layer is Qwen3.5's decoder layer with linear attention as its token mixer: the input norm,
one fused input projection (q, k and v for the causal conv, z for the output gate, b and a for
the update's strength and decay), the mixer (model/delta_net_ops.py: conv, the gated delta rule
over the sequence's state, token by token), a gated RMSNorm per value head (norm, then
* silu(z)), the output projection, and the MLP (dense or MoE) as in every other layer. Its past
is no KV cache but two states per sequence, in the step's `HybridStates` pools: `slots` name
each sequence's live state, `snapshots` the states copied out at block boundaries for the
prefix cache (engine/state_cache.py).

Same contract as llama.py's `BoundDecoderLayer.forward`: the residual add is folded into the
next norm, so a layer returns its output unadded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoserve.model.arch import ArchConfig
from nanoserve.model.delta_net_ops import delta_rule
from nanoserve.model.layer_features import GELU_TANH, LayerFeatures
from nanoserve.model.layer_ops import OpTable, StepContext
from nanoserve.model.moe import BoundMoe, MoeBlock
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.profiling import scope


@dataclass(frozen=True, slots=True)
class HybridStates:
    """The DeltaNet states one forward reads and writes (the runner's pools, this step's
    sequences). Sequence n's tokens are rows [query_start[n], query_start[n + 1])."""

    conv_states: torch.Tensor  # [slots, linear layers, conv_dim, conv_kernel - 1] float32
    ssm_states: torch.Tensor  # [slots, linear layers, value heads, key dim, value dim] float32,
    # bfloat16 or float16 (--mamba-ssm-cache-dtype)
    slots: torch.Tensor  # [N] int32: each sequence's live state
    query_start: torch.Tensor  # [N + 1] int32
    snapshots: torch.Tensor  # [T] int32: -1, or the slot the state after token t is copied to


class DeltaNetLayer(nn.Module):
    """One Gated DeltaNet layer's weights (linear layer `linear_index` of its model)."""

    # its matmul weights, in the order a forward multiplies by them (None where absent)
    MATMUL_WEIGHTS = ("in_proj", "ba_proj", "out_proj", "gate_up_proj", "down_proj")

    def __init__(self, arch: ArchConfig, index: int, features: LayerFeatures | None = None
                 ) -> None:
        super().__init__()
        shape = arch.linear
        assert shape is not None, "a DeltaNet layer needs the model's LinearAttentionConfig"
        self.arch = arch
        self.shape = shape
        self.features = features or LayerFeatures.of(arch)
        self.linear_index = arch.linear_layers.index(index)
        heads = shape.num_value_heads
        self.input_layernorm = _param(arch.hidden_size)
        # rows: q, k, v (the conv's channels) and z (value_dim); b and a (one per head) apart,
        # where a GGUF file keeps them in float while the big rows are quantized
        self.in_proj = _param(shape.conv_dim + shape.value_dim, arch.hidden_size)
        self.ba_proj = _param(2 * heads, arch.hidden_size)
        self.conv_weight = _param(shape.conv_dim, shape.conv_kernel)
        self.neg_exp_a = _param(heads)  # -exp(A_log): the decay rate's scale, per head
        self.dt_bias = _param(heads)
        self.norm = _param(shape.value_head_dim)  # the gated norm's weight, used as it is
        self.out_proj = _param(arch.hidden_size, shape.value_dim)
        self.post_attention_layernorm = _param(arch.hidden_size)
        self.moe = MoeBlock(arch) if arch.moe is not None and arch.moe.is_sparse(index) else None
        self.gate_up_proj = (_param(2 * arch.intermediate_size, arch.hidden_size)
                             if self.moe is None else None)
        self.down_proj = (_param(arch.hidden_size, arch.intermediate_size)
                          if self.moe is None else None)

    def bind(self, table: OpTable, group: TensorParallelGroup, index: int,
             kv_group: int) -> BoundDeltaNetLayer:
        return BoundDeltaNetLayer(self, table, group)


class BoundDeltaNetLayer:
    """A DeltaNetLayer's weights bound to an op table (see the module)."""

    __slots__ = ("act", "add_rms_norm", "all_reduce", "ba_proj", "conv_weight", "down",
                 "dt_bias", "gate_up", "gated_rms_norm", "in_proj", "input_norm", "is_local",
                 "kv_group", "layer", "moe", "neg_exp_a", "norm", "num_heads", "out_proj",
                 "post_norm", "rms_norm", "shape", "splits")

    def __init__(self, layer: DeltaNetLayer, table: OpTable, group: TensorParallelGroup
                 ) -> None:
        self.rms_norm, self.add_rms_norm = table.rms_norm, table.add_rms_norm
        # the fused table's is gated_rows.h's, as the native stack's (hybrid_native.py)
        self.gated_rms_norm = table.gated_rms_norm
        self.act = (table.gelu_tanh_mul if layer.features.activation == GELU_TANH
                    else table.silu_mul)
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.in_proj, self.out_proj = (table.bind_matmul(layer.in_proj),
                                       table.bind_matmul(layer.out_proj))
        self.ba_proj = table.bind_matmul(layer.ba_proj)
        self.gate_up, self.down = (table.bind_matmul(layer.gate_up_proj),
                                   table.bind_matmul(layer.down_proj))
        self.moe = None if layer.moe is None else BoundMoe(layer.moe, table, self.act)
        self.conv_weight, self.neg_exp_a, self.dt_bias = (layer.conv_weight, layer.neg_exp_a,
                                                          layer.dt_bias)
        self.norm = layer.norm
        self.shape = shape = layer.shape
        self.num_heads = shape.num_value_heads
        self.splits = [shape.conv_dim, shape.value_dim]
        self.layer = layer.linear_index
        self.all_reduce = group.all_reduce
        self.kv_group, self.is_local = 0, False  # (no KV cache; read by the layer loop)

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, step: StepContext,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] += delta in place; returns this layer's output, unadded.
        The caches are not read: the layer's past is in `step.states`."""
        eps, states = step.eps, step.states
        assert isinstance(states, HybridStates), "a hybrid model's step carries its states"
        x = (self.rms_norm(hidden, self.input_norm, eps) if delta is None
             else self.add_rms_norm(hidden, delta, self.input_norm, eps))
        qkv, z = self.in_proj(x).split(self.splits, dim=-1)
        b, a = self.ba_proj(x).split(self.num_heads, dim=-1)
        with scope("nanoserve.delta_rule"):  # `bench step`'s "state update"
            core = delta_rule(qkv.contiguous(), a.contiguous(), b.contiguous(),
                              self.conv_weight, self.neg_exp_a, self.dt_bias,
                              states.conv_states, states.ssm_states, self.layer, states.slots,
                              states.query_start, states.snapshots, self.shape)  # [T, value_dim]
        # the gated norm: per value head, RMSNorm with its weight, then * silu(z)
        out = self.out_proj(self.gated_rms_norm(core, z, self.norm, eps))  # [T, hidden]
        x = self.add_rms_norm(hidden, self.all_reduce(out), self.post_norm, eps)
        if self.moe is not None:
            return self.all_reduce(self.moe(x))
        return self.all_reduce(self.down(self.act(self.gate_up(x))))


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device (no memory, no init); the loader puts the weights in."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

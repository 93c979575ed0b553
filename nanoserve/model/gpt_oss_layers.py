"""gpt-oss's decoder layer (transformers' `GptOssDecoderLayer`), over either op table.

What it computes (gpt_oss_arch.py reads the shape):

  x  = norm_in(h);  q, k, v = x Wqkv + b_qkv;  q, k = rope(q, k)     (YaRN, rotate-half)
  h += attention(q, k, v; sinks) Wo + b_o     (a learned logit per query head joins each
                                               softmax's denominator: attention/ adds it)
  x  = norm_post(h);  logits = x Wr + b_r;  the top k, softmaxed over those k
  h += sum over the k experts e of w_e (down_e(swiglu(gate_up_e(x) + b_gu_e)) + b_down_e)

with swiglu(gate, up) = (clamp(up, -L, L) + 1) * g * sigmoid(alpha g), g = clamp(gate, max=L).
The layer keeps Llama's contract (llama.py `BoundDecoderLayer`): its residual add is folded
into the next norm, so it returns its output unadded. q/k/v, RoPE and the cache write are the
table's (`table.bind`, as a Llama layer with a qkv bias binds them); experts run grouped by
expert (moe.py). The router's logits are a row-by-row product-sum: a float matmul's bits may
depend on its row count, and then a token's experts would depend on its batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanoserve.model.arch import ArchConfig
from nanoserve.model.fused_ops import Matmul
from nanoserve.model.layer_features import LayerFeatures
from nanoserve.model.layer_ops import OpTable, StepContext
from nanoserve.model.moe import ExpertWeights, group_by_expert, run_experts, run_token


class GptOssMoe(nn.Module):
    """A layer's router `gate` [E, hidden] with its bias [E], and E experts, each gate and up fused
    ([gate; up] rows, de-interleaved at load) with their biases."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        experts = arch.gpt_oss
        assert experts is not None, "a gpt-oss model"
        hidden, inter = arch.hidden_size, arch.intermediate_size
        self.num_experts_per_tok = experts.num_experts_per_tok
        self.limit, self.alpha = experts.swiglu_limit, experts.swiglu_alpha
        self.gate = _param(experts.num_experts, hidden)  # the router (moe.py's name)
        self.router_bias = _param(experts.num_experts)
        self.shared_expert = None  # (none: what bench/floor.py reads of a MoE block)
        self.experts = nn.ModuleList(ExpertWeights(hidden, inter)
                                     for _ in range(experts.num_experts))
        self.gate_up_bias = _param(experts.num_experts, 2 * inter)  # [gate; up] per expert
        self.down_bias = _param(experts.num_experts, hidden)

    def gated_mlps(self) -> list[ExpertWeights]:
        """Every expert: the owners of the block's matmul weights (weight_arena.py)."""
        return list(self.experts)  # type: ignore[arg-type]


class GptOssLayer(nn.Module):
    """One gpt-oss layer's weights (see the module); its forward is BoundGptOssLayer's."""

    MATMUL_WEIGHTS = ("qkv_proj", "o_proj")  # (the experts' are the MoE block's)

    def __init__(self, arch: ArchConfig, index: int, features: LayerFeatures) -> None:
        super().__init__()
        self.arch, self.index, self.features = arch, index, features
        hidden = arch.hidden_size
        qkv_size = arch.q_size + 2 * arch.kv_size
        self.input_layernorm = _param(hidden)
        self.qkv_proj = _param(qkv_size, hidden)
        self.qkv_bias = _param(qkv_size)
        self.o_proj = _param(hidden, arch.q_size)
        self.o_bias = _param(hidden)
        self.sinks = _param(arch.num_heads)  # a logit per query head
        self.post_attention_layernorm = _param(hidden)  # before the experts
        self.moe = GptOssMoe(arch)
        # what the op tables' `bind` reads of a layer (layer_weights.py), absent here
        self.q_norm = self.k_norm = self.gate_up_proj = self.down_proj = None
        self.attn_output_norm = self.mlp_output_norm = None

    def bind(self, table: OpTable, group: Any, index: int, kv_group: int) -> BoundGptOssLayer:
        return BoundGptOssLayer(self, table, index, kv_group)


class BoundGptOssLayer:
    """A GptOssLayer bound to an op table: `forward(hidden, delta, step, k_cache, v_cache)`
    adds `delta` (the previous layer's output) to `hidden` in place and returns this layer's
    output [T, hidden_size], not yet added (llama.py's contract)."""

    def __init__(self, layer: GptOssLayer, table: OpTable, index: int, kv_group: int) -> None:
        calls = table.bind(layer)
        self.layer, self.table = layer, table
        self.qkv, self.rope_store, self.o = calls.qkv, calls.rope_store, calls.o
        self.window = layer.features.windows[index]
        self.is_local = layer.features.uses_local_rope[index]
        self.kv_group = kv_group
        self.sinks = layer.sinks.float().contiguous()
        moe = layer.moe
        self.experts = [_expert(table, e, moe.gate_up_bias[i], moe.down_bias[i], moe.limit,
                                moe.alpha) for i, e in enumerate(moe.gated_mlps())]

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, step: StepContext,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        layer, table, eps = self.layer, self.table, step.eps
        # 1) attention with its sinks, the norm taking the previous layer's residual add
        x = (table.rms_norm(hidden, layer.input_layernorm, eps) if delta is None
             else table.add_rms_norm(hidden, delta, layer.input_layernorm, eps))
        q, k, v = self.rope_store(self.qkv(x), step, k_cache, v_cache)
        attn = step.attend(q, k, v, k_cache, v_cache, step.meta, stored=True,
                           window=self.window, sinks=self.sinks)  # [T, H * D]
        x = table.add_rms_norm(hidden, self.o(attn) + layer.o_bias, layer.post_attention_layernorm,
                               eps)
        # 2) the experts, routed on the normed stream
        return self._experts(x)

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the weighted sum of each token's k experts [T, hidden]."""
        moe = self.layer.moe
        # the router's logits row by row (see the module), then transformers' topk -> softmax
        logits = (x.unsqueeze(1) * moe.gate).sum(dim=-1) + moe.router_bias  # [T, E]
        top, ids = torch.topk(logits, moe.num_experts_per_tok, dim=-1)
        weights = torch.softmax(top, dim=-1)
        if x.shape[0] == 1:
            return run_token(x, weights, ids, self.experts)
        return run_experts(x, group_by_expert(ids, weights, len(self.experts)), self.experts)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[T, 2 I] ([gate | up]) -> [T, I]: (clamp(up, -L, L) + 1) * g * sigmoid(alpha g),
    g = clamp(gate, max=L) (transformers' `GptOssExperts._apply_gate`, op for op)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _expert(table: OpTable, weights: ExpertWeights, gate_up_bias: torch.Tensor,
            down_bias: torch.Tensor, limit: float, alpha: float) -> Matmul:
    gate_up = table.bind_matmul(weights.gate_up_proj)
    down = table.bind_matmul(weights.down_proj)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return down(clamped_swiglu(gate_up(x) + gate_up_bias, limit, alpha)) + down_bias

    return mlp


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device (no memory, no init); the loader puts the weights in."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

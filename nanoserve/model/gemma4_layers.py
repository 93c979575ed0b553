"""Gemma 4's decoder layer (transformers' `Gemma4TextDecoderLayer`), over either op table.

What it computes, beyond Gemma 3's sandwich layer (gemma4_arch.py reads which parts a model
has):

  x   = norm_in(h);  q = rope(norm_q(x Wq)) * sqrt(D)     (attention scale 1: the kernels
        k = rope(norm_k(x Wk)), v = norm(x Wv)            divide q . k by sqrt(D))
        (K = V layers: Wv is Wk; a KV-shared layer computes q only and reads its source
        layer's cache)
  h  += norm_attn_out(attention(q, k, v) Wo)
  m   = GeGLU(norm_pre_ffn(h));  with a MoE block: m = norm_1(m) + norm_2(experts(norm_pre_2(h)))
  h  += norm_mlp_out(m)
  h  += norm_ple(W_proj(gelu_tanh(h W_gate) * ple[layer]))   (per-layer embeddings)
  h  *= layer_scalar

Unlike the Llama layers (llama.py), which hand their output to the next layer's norm to add, a
Gemma 4 layer finishes the residual stream in place (its last step scales all of it) and
returns None. With the fused table the projections run the quantized kernels and q/k norm,
RoPE and the cache write run the fused `rope_store` kernel (the value rows normed first, in
place); the rest is PyTorch ops on both tables. The MoE block routes as transformers'
`Gemma4TextRouter` and runs its experts grouped by expert (moe.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.arch import ArchConfig
from nanoserve.model.attention import write_kv_cache
from nanoserve.model.fused_ops import Matmul, fused_ops
from nanoserve.model.layer_ops import OpTable, StepContext
from nanoserve.model.linear import linear
from nanoserve.model.moe import ExpertWeights, group_by_expert, run_experts, run_token
from nanoserve.model.rope import apply_rope


class Gemma4Moe(nn.Module):
    """The MoE block beside a layer's dense MLP: the router (its input norm has no weight; a
    per-dimension scale, and a per-expert scale on the routing weights) and the experts."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        layers = arch.gemma4
        assert layers is not None and layers.has_moe
        hidden = arch.hidden_size
        self.top_k = layers.num_experts_per_tok
        self.router = _param(layers.num_experts, hidden)
        self.router_scale = _param(hidden)
        self.per_expert_scale = _param(layers.num_experts)
        self.experts = nn.ModuleList(ExpertWeights(hidden, layers.moe_intermediate_size)
                                     for _ in range(layers.num_experts))
        self.pre_norm = _param(hidden)  # pre_feedforward_layernorm_2
        self.dense_out_norm = _param(hidden)  # post_feedforward_layernorm_1
        self.experts_out_norm = _param(hidden)  # post_feedforward_layernorm_2

    def gated_mlps(self) -> list[ExpertWeights]:
        """Every expert: the owners of the block's matmul weights (weight_arena.py)."""
        return list(self.experts)  # type: ignore[arg-type]


class Gemma4Layer(nn.Module):
    """One Gemma 4 layer's weights (see the module); its forward is BoundGemma4Layer's."""

    # its matmul weights, in the order a forward multiplies by them (None where absent)
    MATMUL_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "ple_gate", "ple_proj")

    def __init__(self, arch: ArchConfig, index: int) -> None:
        super().__init__()
        layers = arch.gemma4
        assert layers is not None, "a Gemma 4 model"
        self.arch, self.index = arch, index
        self.head_dim, self.num_kv_heads = layers.head_dims[index], layers.kv_heads[index]
        self.owns_kv = layers.owns_kv(index)
        hidden, q_size = arch.hidden_size, arch.num_heads * self.head_dim
        kv_size = 2 * self.num_kv_heads * self.head_dim if self.owns_kv else 0
        self.input_layernorm = _param(hidden)
        # q, k and v rows (v = k's rows again on a K = V layer; q alone on a KV-shared one)
        self.qkv_proj = _param(q_size + kv_size, hidden)
        self.q_norm = _param(self.head_dim)
        self.k_norm = _param(self.head_dim) if self.owns_kv else None
        self.o_proj = _param(hidden, q_size)
        self.attn_output_norm = _param(hidden)
        self.post_attention_layernorm = _param(hidden)  # before the MLP, as llama.py names it
        intermediate = layers.intermediate_sizes[index]
        self.gate_up_proj = _param(2 * intermediate, hidden)
        self.down_proj = _param(hidden, intermediate)
        self.mlp_output_norm = _param(hidden)
        self.moe = Gemma4Moe(arch) if layers.has_moe else None
        ple = layers.per_layer_input_size
        self.ple_gate = _param(ple, hidden) if ple else None
        self.ple_proj = _param(hidden, ple) if ple else None
        self.ple_norm = _param(hidden) if ple else None
        self.layer_scalar = _param(1)

    def bind(self, table: OpTable, group: Any, index: int, kv_group: int) -> BoundGemma4Layer:
        return BoundGemma4Layer(self, table, index, kv_group)


class BoundGemma4Layer:
    """A Gemma4Layer bound to an op table: `forward(hidden, delta, step, k_cache, v_cache)`
    updates `hidden` [T, hidden_size] in place (after adding `delta`, another layer kind's
    unadded output, where given) and returns None (see the module)."""

    def __init__(self, layer: Gemma4Layer, table: OpTable, index: int, kv_group: int) -> None:
        arch = layer.arch
        features = arch.gemma4
        assert features is not None
        self.layer, self.table = layer, table
        self.index, self.kv_group = index, kv_group
        self.source = features.kv_sources[index]
        self.window = arch.layer_window(index)
        self.is_local = bool(self.window) and arch.rope_local_theta is not None
        self.head_dim, self.num_kv_heads = layer.head_dim, layer.num_kv_heads
        self.num_heads = arch.num_heads
        self.q_scale = float(self.head_dim) ** 0.5  # undoes the kernels' 1 / sqrt(D): scale 1
        self.qkv, self.o = table.bind_matmul(layer.qkv_proj), table.bind_matmul(layer.o_proj)
        self.gate_up = table.bind_matmul(layer.gate_up_proj)
        self.down = table.bind_matmul(layer.down_proj)
        self.experts: list[Matmul] = []
        if layer.moe is not None:
            self.experts = [_expert(table, e) for e in layer.moe.experts]  # type: ignore[arg-type]
        self.ple_gate = None if layer.ple_gate is None else table.bind_matmul(layer.ple_gate)
        self.ple_proj = None if layer.ple_proj is None else table.bind_matmul(layer.ple_proj)
        self.rope_kernel = fused_ops().rope_store if table.is_fused else None

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, step: StepContext,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        layer, table, eps = self.layer, self.table, step.eps
        if delta is not None:
            hidden.add_(delta)
        # 1) attention: its output normed, then added
        x = table.rms_norm(hidden, layer.input_layernorm, eps)
        q, k, v = self._qkv(self.qkv(x), step, k_cache, v_cache)
        attn = step.attend(q * self.q_scale, k, v, k_cache, v_cache, step.meta, stored=True,
                           window=self.window)  # [T, H * D]
        attn = table.rms_norm(self.o(attn), layer.attn_output_norm, eps)
        # 2) the MLP (and the MoE block beside it) on the stream after the attention
        x = table.add_rms_norm(hidden, attn, layer.post_attention_layernorm, eps)
        mlp = self.down(table.gelu_tanh_mul(self.gate_up(x)))
        if layer.moe is not None:
            mlp = self._with_experts(hidden, mlp, eps)
        hidden.add_(table.rms_norm(mlp, layer.mlp_output_norm, eps))
        # 3) the per-layer embedding's gated residual, then the layer's scale
        if self.ple_gate is not None and self.ple_proj is not None:
            ple = step.scratch["per_layer_inputs"][:, self.index]  # [T, P]
            gate = F.gelu(self.ple_gate(hidden), approximate="tanh") * ple
            assert layer.ple_norm is not None
            hidden.add_(table.rms_norm(self.ple_proj(gate), layer.ple_norm, eps))
        hidden.mul_(layer.layer_scalar)

    def _qkv(self, qkv: torch.Tensor, step: StepContext, k_cache: torch.Tensor,
             v_cache: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q [T, H, D] normed and turned; k, v written to the cache where this layer owns one
        (a KV-shared layer gets its source's, this step's, where attention reads them)."""
        layer, eps = self.layer, step.eps
        num_tokens, dim = qkv.shape[0], self.head_dim
        q_size = self.num_heads * dim
        if not layer.owns_kv:
            q = F.rms_norm(qkv.view(num_tokens, self.num_heads, dim), (dim,), layer.q_norm, eps)
            cos, sin = step.cos, step.sin
            if self.rope_kernel is not None:  # the fused table passes whole tables
                cos = cos.index_select(0, step.positions).unsqueeze(1)
                sin = sin.index_select(0, step.positions).unsqueeze(1)
            shared = step.scratch.get(("kv", self.source), (None, None))
            return apply_rope(q, cos, sin), *shared
        kv_size = self.num_kv_heads * dim
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, dim)
        if self.rope_kernel is not None:
            v.copy_(F.rms_norm(v, (dim,), None, eps))  # the value's norm has no weight
            q = self.rope_kernel(qkv, None, layer.q_norm, layer.k_norm, eps, step.cos, step.sin,
                                 step.positions, k_cache, v_cache, step.cache_index)
            k: torch.Tensor | None = qkv[:, q_size : q_size + kv_size].view(
                num_tokens, self.num_kv_heads, dim)
            v_out: torch.Tensor | None = v
        else:
            q = F.rms_norm(qkv[:, :q_size].view(num_tokens, self.num_heads, dim), (dim,),
                           layer.q_norm, eps)
            k = F.rms_norm(qkv[:, q_size : q_size + kv_size].view(
                num_tokens, self.num_kv_heads, dim), (dim,), layer.k_norm, eps)
            q, k = apply_rope(q, step.cos, step.sin), apply_rope(k, step.cos, step.sin)
            v_out = F.rms_norm(v, (dim,), None, eps)
            write_kv_cache(k, v_out, k_cache, v_cache, step.cache_index)
        if not step.reads_new_kv:
            k = v_out = None
        step.scratch[("kv", self.index)] = (k, v_out)
        return q, k, v_out

    def _with_experts(self, residual: torch.Tensor, mlp: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """The dense MLP's output `mlp` normed, plus the experts' normed output, the experts
        routed on (and run over) the stream before the MLP's norm, `residual`."""
        moe, table = self.layer.moe, self.table
        assert moe is not None
        hidden_size = residual.shape[-1]
        routed = F.rms_norm(residual, (hidden_size,), None, eps) * moe.router_scale \
            * hidden_size ** -0.5
        # the router's logits row by row (a float matmul's bits may depend on its row count:
        # then a token's experts and weights would depend on its batch)
        logits = (routed.unsqueeze(1) * moe.router).sum(dim=-1)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)) * moe.per_expert_scale[ids]
        x = table.rms_norm(residual, moe.pre_norm, eps)
        out = (run_token(x, weights, ids, self.experts) if x.shape[0] == 1
               else run_experts(x, group_by_expert(ids, weights, len(self.experts)),
                                self.experts))
        return (table.rms_norm(mlp, moe.dense_out_norm, eps)
                + table.rms_norm(out, moe.experts_out_norm, eps))


def _expert(table: OpTable, weights: ExpertWeights) -> Matmul:
    gate_up = table.bind_matmul(weights.gate_up_proj)
    down = table.bind_matmul(weights.down_proj)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return down(table.gelu_tanh_mul(gate_up(x)))

    return mlp


def per_layer_inputs(model: Any, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Each token's input to each layer [T, L, P] (transformers' get_per_layer_inputs and
    project_per_layer_inputs): the token's row of the per-layer table scaled by sqrt(P), and
    the embedding `hidden` [T, H] projected, scaled by 1 / sqrt(H) and normed, averaged by
    1 / sqrt(2)."""
    arch = model.arch
    layers = arch.gemma4
    num_tokens, size = input_ids.shape[0], layers.per_layer_input_size
    table = model.embed_tokens_per_layer
    rows = (F.embedding(input_ids, table) if isinstance(table, torch.Tensor)
            else table.rows(input_ids))  # quantized blocks, dequantized row by row (exact)
    tokens = rows * torch.tensor(size ** 0.5, dtype=rows.dtype)
    projected = linear(hidden, model.per_layer_model_projection) * arch.hidden_size ** -0.5
    projected = F.rms_norm(projected.view(num_tokens, arch.num_layers, size), (size,),
                           model.per_layer_projection_norm, arch.rms_norm_eps)
    return (projected + tokens.view(num_tokens, arch.num_layers, size)) * 2.0 ** -0.5


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap): Gemma's final logit softcap (None: the logits as they are)."""
    if not cap:
        return logits
    return torch.tanh(logits / cap).mul_(cap)


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device (no memory, no init); the loader puts the weights in."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

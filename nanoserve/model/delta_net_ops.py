"""Gated DeltaNet's mixer for a flat batch of sequences (`csrc/delta_net.cpp`, and its PyTorch
reference): one Qwen3.5 linear-attention layer's work between the input projections and the
gated norm.

Contract (`delta_rule`, `delta_rule_reference`). Sequence n's tokens are rows
[query_start[n], query_start[n + 1]) of `qkv` [T, conv_dim] (channels q, k: key_dim each, then
v: value_dim; before the conv), `a` and `b` [T, value_heads]; its state is slot `slots[n]` of
the pools, at linear layer `layer`: conv_states [slots, layers, conv_dim, conv_kernel - 1] (the
last inputs, oldest first) and ssm_states [slots, layers, value_heads, key_head_dim,
value_head_dim] (S, value dims contiguous). A fresh sequence's slot is zeroed by the caller.
Per sequence, exactly transformers' Qwen3_5GatedDeltaNet: the causal depthwise conv over the
state and the tokens, SiLU, split q, k, v; q and k l2-normalised (eps 1e-6), q scaled by
key_head_dim ** -0.5; beta = sigmoid(b), g = neg_exp_a * softplus(a + dt_bias); per token
S *= exp(g), delta = (v - S^T k) * beta, S += k delta^T, o = S^T q. Value head j reads key head
`shape.key_head_of(j)`. Returns core [T, value_dim] (o of every token, before the gated norm);
both states are left past the sequence's tokens, and where snapshots[t] >= 0 both states as they
stand after token t are copied to that slot (no live slot of the call: threads write both).

State types (--mamba-ssm-cache-dtype, engine/state_pool.py). The conv state is float32; S is
float32, bfloat16 or float16. A 16-bit S is read as float32, every op runs in float32 as for a
float32 S, and after each token S is rounded to its type (nearest, ties to even, as torch's
`.to` rounds): o of a token reads S before that rounding, the next token after it. Rounding
every token, not once a call (vLLM's GPU kernels keep S in float32 through a call), keeps a
token's bits independent of chunks and of a resume from a snapshot. With a float32 S nothing is
rounded: the bits are those of a float32 pool.

Why a hand kernel: a token's bits must not depend on how its sequence was cut into calls or what
shares the call (the prefix cache resumes from snapshots, and a resumed prompt must continue bit
for bit). So tokens go one at a time through the recurrent form, never the chunked form (whose
bits move with chunk boundaries), every sum in a fixed order, built only for the avx2 tier; the
reference keeps the property too (each op on one token's tensors). Measured against
transformers' functions (conv, l2norm and rule) for Qwen3.5-0.8B's layer (16 + 16 heads of 128,
conv 4) on an AMD EPYC family 26 (Zen 5), torch's 2 threads: a 512-token prefill takes 9.4 ms
here, 27 ms in torch_chunk_gated_delta_rule (23-39 over runs), 74 ms in
torch_recurrent_gated_delta_rule and 84 ms in the reference; a one-token decode of 32 sequences
2.0 ms here, 28 ms in torch_recurrent_gated_delta_rule, 8 ms in the reference. The kernel runs
at the FMA pipes' rate (csrc/delta_net.cpp says why and what else was tried).

The C++ kernel equals the reference within 1e-5 (other sum orders and FMA), not bit for bit; it
takes head dims that are multiples of 8 (key_head_dim at most 256) and conv_kernel in [2, 8]
(else the reference runs). It runs on torch's intra-op threads (`torch.set_num_threads`); its
bits do not depend on their number.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from nanoserve.model.linear_arch import LinearAttentionConfig
from nanoserve.native import load_kernels


def kernels() -> ModuleType | None:
    """The compiled `delta_net` extension (avx2 tier only), or None where it cannot be built."""
    return load_kernels("delta_net")


def fits_kernel(shape: LinearAttentionConfig) -> bool:
    """Whether the C++ kernel takes this shape (its 8-float lanes, its stack buffers)."""
    return (shape.key_head_dim % 8 == 0 and shape.value_head_dim % 8 == 0
            and shape.key_head_dim <= 256 and 2 <= shape.conv_kernel <= 8)


def delta_rule(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
               neg_exp_a: torch.Tensor, dt_bias: torch.Tensor, conv_states: torch.Tensor,
               ssm_states: torch.Tensor, layer: int, slots: torch.Tensor,
               query_start: torch.Tensor, snapshots: torch.Tensor,
               shape: LinearAttentionConfig) -> torch.Tensor:
    """core [T, value_dim] (see the module); the C++ kernel for CPU tensors where it loads,
    else `delta_rule_reference`. Tensors contiguous float32 (ssm_states float32, bfloat16 or
    float16); slots, query_start and snapshots int32 CPU tensors."""
    if qkv.device.type == "cpu" and fits_kernel(shape):
        native = kernels()
        if native is not None:
            return native.delta_rule(qkv, a, b, conv_weight, neg_exp_a, dt_bias, conv_states,
                                     ssm_states, layer, slots, query_start, snapshots,
                                     shape.num_key_heads, shape.v_heads_tiled)
    return delta_rule_reference(qkv, a, b, conv_weight, neg_exp_a, dt_bias, conv_states,
                                ssm_states, layer, slots, query_start, snapshots, shape)


def delta_rule_reference(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         conv_weight: torch.Tensor, neg_exp_a: torch.Tensor,
                         dt_bias: torch.Tensor, conv_states: torch.Tensor,
                         ssm_states: torch.Tensor, layer: int, slots: torch.Tensor,
                         query_start: torch.Tensor, snapshots: torch.Tensor,
                         shape: LinearAttentionConfig) -> torch.Tensor:
    """`delta_rule` in plain PyTorch, on any device: one Python loop over each sequence's
    tokens (the test oracle, and the path where the kernel does not run)."""
    core = qkv.new_empty(qkv.shape[0], shape.value_dim)  # [T, value_dim]
    key_heads = torch.tensor([shape.key_head_of(h) for h in range(shape.num_value_heads)],
                             device=qkv.device)
    starts, snapshot_slots = query_start.tolist(), snapshots.tolist()  # CPU tensors: no sync
    for n, slot in enumerate(slots.tolist()):
        first, last = starts[n], starts[n + 1]
        if first == last:
            continue
        seq_snapshots = snapshot_slots[first:last]
        conv = _conv(qkv[first:last], conv_weight, conv_states[slot, layer], conv_states, layer,
                     seq_snapshots)
        gates = _Gates(a[first:last], b[first:last], neg_exp_a, dt_bias)
        _recur(conv, gates, key_heads, shape, ssm_states[slot, layer], ssm_states, layer,
               seq_snapshots, core[first:last])
    return core


def _conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
          conv_states: torch.Tensor, layer: int, snapshot_slots: list[int]) -> torch.Tensor:
    """The causal depthwise conv (before SiLU) of one sequence's tokens x [L, conv_dim] after
    `state` [conv_dim, K - 1]; advances the state in place and writes the conv snapshots. Tap
    by tap, exact element-wise products and sums, so no row's bits depend on the call's rows."""
    length, taps = x.shape[0], weight.shape[1]
    ext = torch.cat([state.t(), x])  # [K - 1 + L, conv_dim]
    out = ext[:length] * weight[:, 0]
    for j in range(1, taps):
        out = out + ext[j:j + length] * weight[:, j]
    for i, snapshot in enumerate(snapshot_slots):
        if snapshot >= 0:
            conv_states[snapshot, layer].copy_(ext[i + 1:i + taps].t())
    state.copy_(ext[length:].t())
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


@dataclass(frozen=True)
class _Gates:
    """One sequence's a, b [L, value_heads] and the layer's per-head weights."""

    a: torch.Tensor
    b: torch.Tensor
    neg_exp_a: torch.Tensor
    dt_bias: torch.Tensor

    def of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token i's decay exp(g) and beta [value_heads]."""
        g = self.neg_exp_a * F.softplus(self.a[i] + self.dt_bias)
        return g.exp(), torch.sigmoid(self.b[i])


def _recur(conv: torch.Tensor, gates: _Gates, key_heads: torch.Tensor,
           shape: LinearAttentionConfig, state: torch.Tensor, ssm_states: torch.Tensor,
           layer: int, snapshot_slots: list[int], out: torch.Tensor) -> None:
    """The gated delta rule over one sequence's L tokens (conv [L, conv_dim] before SiLU), token
    by token, as transformers' torch_recurrent_gated_delta_rule; `state` [value_heads, dk, dv]
    updated in place, in float32 and rounded to a 16-bit state's type after each token (see
    the module). Every op, the transcendental ones included, runs on one token's tensors:
    a CPU op's vector loop and its scalar tail round differently, so an op over a whole chunk
    would give a token bits that depend on its place in the chunk."""
    heads, dk, dv = shape.num_value_heads, shape.key_head_dim, shape.value_head_dim
    scale = dk ** -0.5
    s = state.to(torch.float32, copy=True)
    rounds = state.dtype != torch.float32
    for i in range(conv.shape[0]):
        q, k, v = F.silu(conv[i]).split([shape.key_dim, shape.key_dim, shape.value_dim])
        q_i = (_l2norm(q.view(-1, dk)) * scale)[key_heads]  # [value_heads, dk]
        k_i = _l2norm(k.view(-1, dk))[key_heads]
        decay, beta = gates.of(i)  # [value_heads]
        s = s * decay[:, None, None]
        kv_mem = (s * k_i[..., None]).sum(dim=-2)  # [value_heads, dv]
        delta = (v.view(heads, dv) - kv_mem) * beta[:, None]
        s = s + k_i[..., None] * delta[:, None, :]
        out[i] = (s * q_i[..., None]).sum(dim=-2).view(-1)
        if rounds:
            s = s.to(state.dtype).float()
        if snapshot_slots[i] >= 0:
            ssm_states[snapshot_slots[i], layer].copy_(s)
    state.copy_(s)

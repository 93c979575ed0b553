"""Llama-family decoder in plain PyTorch: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The model runs on a flat batch: every scheduled token of every request in one [num_tokens] row
vector, with attention routed through the paged KV cache (see attention.py). Projections that
read the same input are fused at load time (q/k/v into one matmul, gate/up into one).

Two paths run the same layer. `DecoderLayer.forward` is plain PyTorch: with exact weights
(`--quantization none`) it is the path held equal to transformers token for token, and it
stays the only one there. With quantized weights on the CPU, `FusedDecoderLayer` runs each
layer as nine calls, the residual adds folded into the next norm and the element-wise work in
C++ (fused_ops.py): norm, qkv matmul, rope_store, attention, o matmul, add_rms_norm, gate_up
matmul, silu_mul, down matmul. The plain layer's profile at batch 1 (torch.profiler, per layer)
was those four matmuls and attention plus ~25 dispatched ops: 2 rms_norm (pow, mean, add,
rsqrt, 2 mul, type_as inside each), the slices and views of qkv, RoPE's 2 slices, neg, cat,
2 mul, add and split, the cache write's 2 transposes, 2 float16 casts and 2 index_copy_, 2
residual adds, chunk, silu and mul, with ~17 allocations. The fused path also skips per-step
and per-layer Python: the cos/sin lookup (rope_store reads the table by position), nn.Module
calls and parameter lookups, and linear()'s dispatch (each matmul is a bound kernel call).
Its hidden states differ from the plain path's by ~2e-7 relative (tests/model/
test_fused_model.py), a last-bit difference that int8 activation rounding can amplify as much
as any other (see there).

`bench step` on the default model (Q4_1, float16 cache, context 256), plain vs fused toggled on
one engine in interleaved rounds (medians of 8 rounds of 10 steps at batch 1, 4 of 5 at 64)
on the 2-core machine while other engineers' jobs ran (load average 5-10):

                        batch 1, 1 thread   batch 64, 1 thread
    element-wise         5.6 -> 1.8 ms       41.6 -> 15.2 ms
    model Python         5.7 -> 2.7 ms       25.2 -> 12.4 ms
    attention            3.1 -> 1.5 ms       98.5 -> 88.0 ms   (the cache write moved out)
    step                23.6 -> 15.5 ms     391 -> 351 ms      (a second campaign: 25.1 ->
                                                                16.4 and 316 -> 253 ms)

With 2 threads every step was dominated by OpenMP waiting for the loaded cores (batch-1 steps
of 0.6-1.9 s); there the element-wise and Python buckets still fell 2-3x (batch 1: 22.8 ->
8.9 ms and 26.4 -> 10.2 ms). The layer's element-wise work alone, min of many calls: 127 us
-> 4.8 us per layer at batch 1, 267-440 -> 75-119 us at 64 (fused_ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.arch import ArchConfig
from nanoserve.model.attention import AttentionMetadata, paged_attention
from nanoserve.model.fused_ops import FusedOps, bind_matmul, fused_ops, kernels
from nanoserve.model.linear import linear
from nanoserve.model.rope import RotaryEmbedding, apply_rope


class DecoderLayer(nn.Module):
    """Pre-norm attention block, then pre-norm gated MLP, each with a residual add."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        qkv_size = arch.q_size + 2 * arch.kv_size
        self.input_layernorm = _param(arch.hidden_size)
        self.qkv_proj = _param(qkv_size, arch.hidden_size)
        self.qkv_bias = _param(qkv_size) if arch.has_qkv_bias else None
        self.o_proj = _param(arch.hidden_size, arch.q_size)
        self.q_norm = _param(arch.head_dim) if arch.has_qk_norm else None
        self.k_norm = _param(arch.head_dim) if arch.has_qk_norm else None
        self.post_attention_layernorm = _param(arch.hidden_size)
        self.gate_up_proj = _param(2 * arch.intermediate_size, arch.hidden_size)
        self.down_proj = _param(arch.hidden_size, arch.intermediate_size)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        arch = self.arch
        num_tokens = hidden.shape[0]
        eps = arch.rms_norm_eps
        # 1) attention
        x = F.rms_norm(hidden, (arch.hidden_size,), self.input_layernorm, eps)
        qkv = linear(x, self.qkv_proj, self.qkv_bias)  # [T, (H + 2 * Hkv) * D]
        qk_size = arch.q_size + arch.kv_size
        v = qkv[:, qk_size:].view(num_tokens, arch.num_kv_heads, arch.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, :qk_size].split([arch.q_size, arch.kv_size], dim=-1)
            q = F.rms_norm(q.view(num_tokens, arch.num_heads, arch.head_dim), (arch.head_dim,),
                           self.q_norm, eps)
            k = F.rms_norm(k.view(num_tokens, arch.num_kv_heads, arch.head_dim),
                           (arch.head_dim,), self.k_norm, eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            # q and k sit side by side in qkv: one rotation of [T, H + Hkv, D] costs half the
            # dispatches of two (each element's arithmetic is the same)
            qk = apply_rope(qkv[:, :qk_size].view(num_tokens, -1, arch.head_dim), cos, sin)
            q, k = qk.split([arch.num_heads, arch.num_kv_heads], dim=1)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta)  # [T, H * D]
        hidden = hidden + linear(attn, self.o_proj)
        # 2) MLP
        x = F.rms_norm(hidden, (arch.hidden_size,), self.post_attention_layernorm, eps)
        gate, up = linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return hidden + linear(F.silu(gate) * up, self.down_proj)


@dataclass(frozen=True, slots=True)
class FusedStep:
    """What every layer's fused forward reads in one step."""

    positions: torch.Tensor  # [T] int64, rows of the RoPE tables
    cos_table: torch.Tensor  # [max_positions, head_dim], RotaryEmbedding's own
    sin_table: torch.Tensor
    meta: AttentionMetadata
    has_prefills: bool
    eps: float


class FusedDecoderLayer:
    """DecoderLayer's forward in nine calls (fused_ops.py), for quantized weights on the CPU:
    norm, qkv matmul, rope_store, attention, o matmul, add_rms_norm, gate_up matmul, silu_mul,
    down matmul. The residual add is folded into the next norm, so a layer returns its output
    unadded and the next layer (or the final norm) adds it to `hidden` in place.

    Weights and matmul calls are plain attributes, read without nn.Module's `__getattr__`.
    """

    __slots__ = ("down", "gate_up", "head_dim", "input_norm", "k_norm", "kv_size", "o", "ops",
                 "post_norm", "q_norm", "q_size", "qkv", "qkv_bias")

    def __init__(self, layer: DecoderLayer, ops: FusedOps) -> None:
        arch, profiled = layer.arch, ops.is_profiled
        self.ops = ops
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.qkv_bias, self.q_norm, self.k_norm = layer.qkv_bias, layer.q_norm, layer.k_norm
        self.qkv = bind_matmul(layer.qkv_proj, profiled)  # its bias goes to rope_store
        self.o = bind_matmul(layer.o_proj, profiled)
        self.gate_up = bind_matmul(layer.gate_up_proj, profiled)
        self.down = bind_matmul(layer.down_proj, profiled)
        self.q_size, self.kv_size, self.head_dim = arch.q_size, arch.kv_size, arch.head_dim

    def forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, step: FusedStep,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] += delta (the previous layer's output; None before the
        first layer), in place; returns this layer's output [T, hidden_size], not yet added."""
        ops, eps = self.ops, step.eps
        # 1) attention
        x = (ops.rms_norm(hidden, self.input_norm, eps) if delta is None
             else ops.add_rms_norm(hidden, delta, self.input_norm, eps))
        qkv = self.qkv(x)  # [T, (H + 2 * Hkv) * D]
        q = ops.rope_store(qkv, self.qkv_bias, self.q_norm, self.k_norm, eps, step.cos_table,
                           step.sin_table, step.positions, k_cache, v_cache,
                           step.meta.cache_index)  # [T, H, D]; k and v are in the cache
        k = v = None
        if step.has_prefills:  # chunks that attend to themselves read k and v; the two
            # views cost ~7 us a layer (measured), so decode-only steps do without them
            num_tokens, kv_end = qkv.shape[0], self.q_size + self.kv_size
            k = qkv[:, self.q_size : kv_end].view(num_tokens, -1, self.head_dim)
            v = qkv[:, kv_end:].view(num_tokens, -1, self.head_dim)
        attn = paged_attention(q, k, v, k_cache, v_cache, step.meta, stored=True)  # [T, H * D]
        # 2) MLP, its norm taking the attention block's residual add
        x = ops.add_rms_norm(hidden, self.o(attn), self.post_norm, eps)
        return self.down(ops.silu_mul(self.gate_up(x)))


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, and the LM head applied only to rows that sample."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = _param(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = _param(arch.hidden_size)
        # Tied models reuse the embedding matrix: the loader points `lm_head` at the same tensor.
        self.lm_head = _param(arch.vocab_size, arch.hidden_size)
        self.rotary: RotaryEmbedding | None = None
        # The fused path (FusedDecoderLayer) or the plain one: None decides at the first
        # forward (quantized weights on the CPU in float32, with the kernel built); tests set
        # it to run both on one model.
        self.use_fused_ops: bool | None = None
        self._fused_layers: dict[bool, list[FusedDecoderLayer]] = {}  # by is_profiled

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers)  # type: ignore[arg-type]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden_size]."""
        assert self.rotary is not None, "weights not loaded: use nanoserve.model.loader.load_model"
        if self.use_fused_ops is None:
            self.use_fused_ops = self._can_fuse()
        if self.use_fused_ops:
            return self._forward_fused(input_ids, positions, kv_caches, meta)
        cos, sin = self.rotary.lookup(positions)  # [T, 1, D] each, shared by all layers
        hidden = self._embed(input_ids)  # [T, hidden]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, meta)
        return F.rms_norm(hidden, (self.arch.hidden_size,), self.norm, self.arch.rms_norm_eps)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       meta: AttentionMetadata) -> torch.Tensor:
        """forward's result by FusedDecoderLayer: the same layers, ~9 calls each."""
        assert self.rotary is not None
        profiled = torch.autograd._profiler_enabled()  # once per step, not per call
        layers = self._fused_layers.get(profiled)
        if layers is None:
            ops = fused_ops(profiled)
            layers = self._fused_layers[profiled] = [FusedDecoderLayer(layer, ops)
                                                     for layer in self.decoder_layers]
        eps = self.arch.rms_norm_eps
        step = FusedStep(positions, self.rotary.cos_table, self.rotary.sin_table, meta,
                         bool(meta.prefills), eps)
        hidden = self._embed(input_ids)  # [T, hidden], a fresh tensor: updated in place
        delta = None
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            delta = layer.forward(hidden, delta, step, k_cache, v_cache)
        assert delta is not None, "a model has at least one layer"
        return layers[0].ops.add_rms_norm(hidden, delta, self.norm, eps)

    def _can_fuse(self) -> bool:
        """Quantized matmul weights (any mode but "none") on the CPU in float32, and the kernel
        built: "none" stays the exact plain-PyTorch path."""
        layer = self.decoder_layers[0]
        weights = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        return (self.norm.device.type == "cpu" and self.norm.dtype == torch.float32
                and self.rotary is not None and self.rotary.cos_table.dtype == torch.float32
                and any(not isinstance(w, torch.Tensor) for w in weights)
                and kernels() is not None)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens
        if isinstance(table, torch.Tensor):
            return F.embedding(input_ids, table)
        return table.rows(input_ids)  # quantized blocks, dequantized row by row (exact)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] in float32 (the sampler's dtype)."""
        return linear(hidden, self.lm_head).float()


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device (no memory, no init); the loader puts the weights in."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

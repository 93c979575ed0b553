"""Llama-family decoder in plain PyTorch: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The model runs on a flat batch: every scheduled token of every request in one [num_tokens] row
vector, with attention routed through the paged KV cache (see attention.py). Projections that
read the same input are fused at load time (q/k/v into one matmul, gate/up into one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.arch import ArchConfig
from nanoserve.model.attention import AttentionMetadata, paged_attention
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

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers)  # type: ignore[arg-type]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden_size]."""
        assert self.rotary is not None, "weights not loaded: use nanoserve.model.loader.load_model"
        cos, sin = self.rotary.lookup(positions)  # [T, 1, D] each, shared by all layers
        hidden = self._embed(input_ids)  # [T, hidden]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, meta)
        return F.rms_norm(hidden, (self.arch.hidden_size,), self.norm, self.arch.rms_norm_eps)

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

"""Llama-family decoder in plain PyTorch: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The model runs on a flat batch: every scheduled token of every request in one [num_tokens] row
vector, with attention routed through the paged KV cache by a backend (the attention/ package).
Projections that read the same input are fused at load time (q/k/v into one matmul, gate/up
into one). The model holds its weights and one forward, the layer loop (`CausalLM.forward`:
the final hidden states); `compute_logits` turns the rows that sample into float32 logits.
Which op table the layers are bound to, and whether the attention backend's native stack runs
them instead, the model runner's plan chooses (forward_plan.py).

One layer forward (`BoundDecoderLayer.forward`) runs over one of two op tables (layer_ops.py),
each folding a residual add into the next norm. With exact weights (`--quantization none`) the
table is plain PyTorch, held equal to transformers token for token. With quantized weights on
the CPU it is nine calls a layer, the element-wise work in C++ (fused_ops.py), whose hidden
states differ from the plain path's by ~2e-7 relative (tests/model/test_fused_model.py). Why:
the plain layer dispatches ~25 small ops between its four matmuls, and the fused table takes a
batch-1 step from 23.6 to 15.5 ms on one thread (docs/benchmarks.md, "The fused op table
against the plain layer"). Where the fused table runs over the CPU paged attention at one rank,
every layer and the final norm are one native call instead (native_layers.py, bit for bit;
`--enforce-eager` keeps this loop).

Under tensor parallelism each rank holds its heads, MLP rows and vocabulary rows (shard.py);
each layer all-reduces the attention output projection's and the down projection's partial
sums over its group (parallel.py) before they reach the residual stream; the embedding is a
masked lookup plus an all-reduce, the logits are gathered to rank 0. At one rank the group is
the identity.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.arch import ArchConfig
from nanoserve.model.attention import AttentionBackend, AttentionMetadata
from nanoserve.model.gemma4_layers import Gemma4Layer, per_layer_inputs, softcap
from nanoserve.model.gpt_oss_layers import GptOssLayer
from nanoserve.model.hybrid_layers import DeltaNetLayer, HybridStates
from nanoserve.model.layer_features import GELU_TANH, LayerFeatures
from nanoserve.model.layer_ops import OpTable, StepContext
from nanoserve.model.linear import linear
from nanoserve.model.moe import BoundMoe, MoeBlock
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.model.rope import RotaryEmbedding
from nanoserve.model.shard import local_arch, vocab_range


class DecoderLayer(nn.Module):
    """One layer's weights: pre-norm attention block, then pre-norm gated MLP, each with a
    residual add. Its forward is `BoundDecoderLayer.forward`, over an op table. In a MoE
    layer (layer `index` of a Qwen2/3-MoE) the MLP is moe.py's router and experts."""

    # its matmul weights, in the order a forward multiplies by them (None where absent)
    MATMUL_WEIGHTS = ("qkv_proj", "attn_gate_proj", "o_proj", "gate_up_proj", "down_proj")

    def __init__(self, arch: ArchConfig, index: int = 0,
                 features: LayerFeatures | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.features = features = features or LayerFeatures.of(arch)
        qkv_size = arch.q_size + 2 * arch.kv_size
        self.input_layernorm = _param(arch.hidden_size)
        self.qkv_proj = _param(qkv_size, arch.hidden_size)
        self.qkv_bias = _param(qkv_size) if features.has_qkv_bias else None
        self.o_proj = _param(arch.hidden_size, arch.q_size)
        self.q_norm = _param(arch.head_dim) if features.has_qk_norm else None
        self.k_norm = _param(arch.head_dim) if features.has_qk_norm else None
        self.post_attention_layernorm = _param(arch.hidden_size)  # before the MLP
        # a MoE layer's MLP is its router and experts (moe.py), in place of gate_up and down
        self.moe = MoeBlock(arch) if arch.moe is not None and arch.moe.is_sparse(index) else None
        self.gate_up_proj = (_param(2 * arch.intermediate_size, arch.hidden_size)
                             if self.moe is None else None)
        self.down_proj = (_param(arch.hidden_size, arch.intermediate_size)
                          if self.moe is None else None)
        # Gemma's sandwich: norms of the attention's and the MLP's outputs too
        sandwich = features.has_sandwich_norms
        self.attn_output_norm = _param(arch.hidden_size) if sandwich else None
        self.mlp_output_norm = _param(arch.hidden_size) if sandwich else None
        # Qwen3.5's output gate: attention * sigmoid(x @ attn_gate_proj.T), before o_proj
        self.attn_gate_proj = (_param(arch.q_size, arch.hidden_size)
                               if arch.has_attn_output_gate else None)

    def bind(self, table: OpTable, group: TensorParallelGroup, index: int,
             kv_group: int) -> BoundDecoderLayer:
        return BoundDecoderLayer(self, table, group, index, kv_group)


class BoundDecoderLayer:
    """A DecoderLayer's weights bound to an op table (layer_ops.py): the one layer forward,
    whichever table runs. The residual add is folded into the next norm, so a layer returns
    its output unadded and the next layer (or the final norm) adds it to `hidden` in place.

    Weights and calls are plain attributes, read without nn.Module's `__getattr__`.
    """

    __slots__ = ("add_rms_norm", "all_reduce", "attn_gate", "attn_output_norm", "down",
                 "forward", "gate_up", "input_norm", "is_local", "kv_group", "mlp_output_norm",
                 "moe", "o", "post_norm", "q_scale", "qkv", "rms_norm", "rope_store",
                 "sigmoid_mul", "silu_mul", "window")

    def __init__(self, layer: DecoderLayer, table: OpTable, group: TensorParallelGroup,
                 index: int = 0, kv_group: int = 0) -> None:
        """Layer `index` of its model, its cache rows through KV layer group `kv_group`'s
        block tables (model/kv_groups.py)."""
        calls = table.bind(layer)
        features = layer.features
        self.rms_norm, self.add_rms_norm = table.rms_norm, table.add_rms_norm
        self.silu_mul = table.gelu_tanh_mul if features.activation == GELU_TANH else table.silu_mul
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.attn_output_norm, self.mlp_output_norm = layer.attn_output_norm, layer.mlp_output_norm
        self.qkv, self.rope_store, self.o = calls.qkv, calls.rope_store, calls.o
        self.gate_up, self.down = calls.gate_up, calls.down
        self.moe = None if layer.moe is None else BoundMoe(layer.moe, table, self.silu_mul)
        self.all_reduce = group.all_reduce
        # a windowed layer attends its window, with the local RoPE base where there is one
        self.window = features.windows[index]
        self.kv_group = kv_group
        self.is_local = features.uses_local_rope[index]
        self.q_scale = features.q_scale  # (1.0: q is left as it is)
        self.attn_gate = (None if layer.attn_gate_proj is None
                          else table.bind_matmul(layer.attn_gate_proj))
        self.sigmoid_mul = table.sigmoid_mul  # (_forward_gated's)
        self.forward = (self._forward_sandwich if features.has_sandwich_norms
                        else self._forward if self.attn_gate is None else self._forward_gated)

    def _forward(self, hidden: torch.Tensor, delta: torch.Tensor | None, step: StepContext,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden_size] += delta (the previous layer's output; None before the
        first layer), in place; returns this layer's output [T, hidden_size], not yet added."""
        eps = step.eps
        # 1) attention, its norm taking the previous layer's residual add
        x = (self.rms_norm(hidden, self.input_norm, eps) if delta is None
             else self.add_rms_norm(hidden, delta, self.input_norm, eps))
        # q [T, H, D]; k, v [T, Hkv, D] are in the cache now (and None where not read again)
        q, k, v = self.rope_store(self.qkv(x), step, k_cache, v_cache)
        attn = step.attend(q, k, v, k_cache, v_cache, step.meta, stored=True,
                           window=self.window)  # [T, H * D]
        # 2) MLP, its norm taking the attention block's residual add. Under tensor
        # parallelism o's output is this rank's partial sum: all-reduced before it is added.
        x = self.add_rms_norm(hidden, self.all_reduce(self.o(attn)), self.post_norm, eps)
        # down's output too (or the experts'): all-reduced here, added by the next norm
        if self.moe is not None:
            return self.all_reduce(self.moe(x))
        return self.all_reduce(self.down(self.silu_mul(self.gate_up(x))))

    def _forward_gated(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                       step: StepContext, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> torch.Tensor:
        """Qwen3.5's full attention layer, `_forward`'s contract: the attention's output is
        gated per element by sigmoid(x @ attn_gate.T) before o (transformers'
        Qwen3_5Attention; its q_proj's gate rows, split out at load)."""
        eps, attn_gate = step.eps, self.attn_gate
        assert attn_gate is not None, "a gated attention layer"
        x = (self.rms_norm(hidden, self.input_norm, eps) if delta is None
             else self.add_rms_norm(hidden, delta, self.input_norm, eps))
        q, k, v = self.rope_store(self.qkv(x), step, k_cache, v_cache)
        attn = step.attend(q, k, v, k_cache, v_cache, step.meta, stored=True,
                           window=self.window)  # [T, H * D]
        # the fused table's gate is gated_rows.h's, as the hybrid stack's (hybrid_native.py)
        attn = self.sigmoid_mul(attn, attn_gate(x))
        x = self.add_rms_norm(hidden, self.all_reduce(self.o(attn)), self.post_norm, eps)
        if self.moe is not None:
            return self.all_reduce(self.moe(x))
        return self.all_reduce(self.down(self.silu_mul(self.gate_up(x))))

    def _forward_sandwich(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                          step: StepContext, k_cache: torch.Tensor,
                          v_cache: torch.Tensor) -> torch.Tensor:
        """Gemma's layer, the same contract as `_forward`: the attention's and the MLP's
        outputs are normed before they join the residual stream (so after the all-reduce)."""
        eps = step.eps
        attn_output_norm, mlp_output_norm = self.attn_output_norm, self.mlp_output_norm
        assert attn_output_norm is not None and mlp_output_norm is not None, "a sandwich layer"
        x = (self.rms_norm(hidden, self.input_norm, eps) if delta is None
             else self.add_rms_norm(hidden, delta, self.input_norm, eps))
        q, k, v = self.rope_store(self.qkv(x), step, k_cache, v_cache)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        attn = step.attend(q, k, v, k_cache, v_cache, step.meta, stored=True,
                           window=self.window)  # [T, H * D]
        attn = self.rms_norm(self.all_reduce(self.o(attn)), attn_output_norm, eps)
        x = self.add_rms_norm(hidden, attn, self.post_norm, eps)
        mlp = self.all_reduce(self.down(self.silu_mul(self.gate_up(x))))
        return self.rms_norm(mlp, mlp_output_norm, eps)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, and the LM head applied only to rows that sample."""

    def __init__(self, arch: ArchConfig, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.group = group or TensorParallelGroup()
        self.full_arch = arch  # the whole model's shape, as the checkpoint gives it
        # this rank's heads and MLP rows (the whole model at one rank), and its vocabulary
        # rows [vocab_start, vocab_end) of the embedding and the LM head
        self.arch = arch = local_arch(arch, self.group)
        self.vocab_start, self.vocab_end = vocab_range(arch, self.group)
        num_rows = self.vocab_end - self.vocab_start
        self.embed_tokens = _param(num_rows, arch.hidden_size)
        # what every layer computes beyond Llama's (sandwich norms, GELU, windows, ...)
        self.features = features = LayerFeatures.of(arch)
        # a hybrid's Gated DeltaNet layers among them (hybrid_layers.py)
        self.layers = nn.ModuleList(
            DeltaNetLayer(arch, i, features) if arch.is_linear(i)
            else Gemma4Layer(arch, i) if arch.gemma4 is not None
            else GptOssLayer(arch, i, features) if arch.gpt_oss is not None
            else DecoderLayer(arch, i, features) for i in range(arch.num_layers))
        # Gemma 4's per-layer embeddings: a table [vocab, L * P] and the embedding's
        # projection [L * P, hidden] with its norm (gemma4_layers.py)
        ple = arch.gemma4.per_layer_input_size if arch.gemma4 is not None else 0
        self.embed_tokens_per_layer = _param(num_rows, arch.num_layers * ple) if ple else None
        self.per_layer_model_projection = (_param(arch.num_layers * ple, arch.hidden_size)
                                           if ple else None)
        self.per_layer_projection_norm = _param(ple) if ple else None
        self.norm = _param(arch.hidden_size)
        # Tied models reuse the embedding matrix: the loader points `lm_head` at the same tensor.
        self.lm_head = _param(num_rows, arch.hidden_size)
        self.rotary: RotaryEmbedding | None = None
        self.rotary_local: RotaryEmbedding | None = None  # windowed layers' own base (Gemma)
        # a vision tower (model/vision/) where the checkpoint has one, set by the loader, and
        # its image processor's `normalize` (uint8 [S, S, 3] -> float32 [3, S, S])
        self.vision: nn.Module | None = None
        self.normalize_image: Any = None

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers; in a hybrid model, DeltaNetLayers among them."""
        return list(self.layers)  # type: ignore[arg-type]

    @property
    def is_hybrid(self) -> bool:
        return self.arch.linear is not None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attention: AttentionBackend[Any], meta: AttentionMetadata, table: OpTable,
                layers: list[BoundDecoderLayer], cos: torch.Tensor, sin: torch.Tensor,
                rope_local: tuple[torch.Tensor, torch.Tensor] | None = None,
                group_metas: list[AttentionMetadata] | None = None,
                states: HybridStates | None = None,
                images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden_size],
        through `layers` (this model's, bound to `table`; the runner's `ForwardPlan` chooses
        both, and `cos`, `sin` are `table.rope_tables` at `positions`, `rope_local` the same
        of `rotary_local` where the model has one). `meta` is `attention`'s own, from
        `attention.build_metadata` for this step, and `group_metas` the same for KV layer
        groups 1.. (their own block tables and cache rows); `states` a hybrid model's
        DeltaNet states (their layers ignore their cache pair); `images` the rows whose
        embeddings are an image's features (`embed`)."""
        scratch: dict[Any, Any] = {}  # one per step, shared by the groups' contexts
        steps = [StepContext(positions, cos, sin, attention.forward, m, m.cache_index,
                             m.reads_new_kv, self.arch.rms_norm_eps, states, scratch)
                 for m in (meta, *(group_metas or ()))]  # per KV layer group
        local = steps if rope_local is None else [
            replace(step, cos=rope_local[0], sin=rope_local[1]) for step in steps]
        hidden = self.embed(input_ids, images)  # [T, hidden], fresh: updated in place
        if self.embed_tokens_per_layer is not None:
            scratch["per_layer_inputs"] = per_layer_inputs(self, input_ids, hidden)
        delta = None
        for layer, (k_cache, v_cache) in zip(layers, kv_caches, strict=True):
            # a forward given one metadata (a whole prompt at once, as tests and benchmarks
            # run it) uses it for every group
            group = layer.kv_group if layer.kv_group < len(steps) else 0
            step = (local if layer.is_local else steps)[group]
            delta = layer.forward(hidden, delta, step, k_cache, v_cache)
        if delta is None:  # (Gemma 4's layers finish the stream in place)
            return table.rms_norm(hidden, self.norm, self.arch.rms_norm_eps)
        return table.add_rms_norm(hidden, delta, self.norm, self.arch.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor,
              images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]; `images` (rows [R], features [R, hidden]): those
        rows are the vision tower's features instead, unscaled (transformers scatters them
        over the scaled embeddings: Gemma 3). Under tensor parallelism each rank looks up the
        ids in its vocabulary rows and zeroes the others; the all-reduce then gives every id
        its own row exactly (the other ranks add zeros), as nano-vllm's
        VocabParallelEmbedding."""
        if images is not None:
            rows, features = images
            # a placeholder's id may lie past the vocabulary (Gemma 3's 262144): looked up as 0
            hidden = self.embed(input_ids.index_fill(0, rows, 0))
            return hidden.index_copy_(0, rows, features.to(hidden.dtype))
        if self.group.world_size == 1:
            return self._scaled(self._lookup(input_ids))
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        hidden = self._lookup(torch.where(is_local, input_ids - self.vocab_start, 0))
        return self._scaled(self.group.all_reduce(
            hidden.masked_fill_(~is_local.unsqueeze(-1), 0.0)))

    def _scaled(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gemma multiplies the embedding by sqrt(hidden_size), rounded to its dtype first
        (transformers' Gemma3TextScaledWordEmbedding); in place, the lookup is a fresh tensor."""
        if not self.arch.scales_embedding:
            return hidden
        return hidden.mul_(torch.tensor(self.arch.hidden_size ** 0.5, dtype=hidden.dtype))

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens
        if isinstance(table, torch.Tensor):
            return F.embedding(input_ids, table)
        return table.rows(input_ids)  # quantized blocks, dequantized row by row (exact)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] in float32 (the sampler's dtype). Under
        tensor parallelism each rank multiplies by its vocabulary rows of the head and rank 0
        gathers the slices (the other ranks get their own slice back: they sample nothing)."""
        logits = linear(hidden, self.lm_head).float()
        if self.arch.gemma4 is not None:  # Gemma 4's final softcap
            logits = softcap(logits, self.arch.gemma4.final_logit_softcap)
        return logits if self.group.world_size == 1 else self.group.gather_to_rank0(logits)


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device (no memory, no init); the loader puts the weights in."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)

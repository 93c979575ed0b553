"""A hybrid model's decoder layers in one native call (`csrc/hybrid_layers.cpp`).

What it computes: the Python layer loop of a Qwen3.5/3.6 hybrid over the fused op table,
every layer in turn, then the final norm: hybrid_layers.py's `BoundDeltaNetLayer.forward` for
the Gated DeltaNet layers (its mixer through the same C++ function the `delta_rule` extension
runs, `csrc/delta_net.h`) and llama.py's gated attention (`_forward_gated`) for the others.
The stack makes the Python layers' calls in their order: the fused kernels through the
dispatcher, the two gates (the DeltaNet's gated norm, the attention's sigmoid gate) through
`csrc/gated_rows.h`, whose functions the fused table's `gated_rms_norm` and `sigmoid_mul` run
too (a fixed float order of our own: PyTorch's ops pick their vector code by CPU), and where
the Python layer copies (the splits), the same ATen op. So the hidden states, caches and
DeltaNet states are the Python loop's bit for bit (tests/model/test_hybrid_native.py). The step's
`HybridStates` (its live slots, query_start and snapshot slots) go to every DeltaNet layer as
they go in the Python loop, so a prefix hit, a snapshot or a draft's states are written alike.

It runs where native_layers.py's stack would (the paged CPU backend, one rank, every
projection packed) and the DeltaNet kernel takes the model's shape; never for a model with
experts (the MoE block stays in the Python loop) or a step with images or multimodal RoPE rows
(`ForwardPlan`). Each op is its own call, one after another; a few tokens as one parallel
region (csrc/team_forward.h) is a later step.

Why: a hybrid layer makes some 15 op calls from Python, each microseconds of dispatch for a
decode step's few rows. On the Qwen3.5-0.8B-shaped Q8_0 file the Python loop's step took
1.10x the stack's at batch 1 and 1.07x at batch 8 (interleaved, 2 busy cores; the loop's "model
Python" bucket, 7.6 ms at batch 1, went to zero). Figures: docs/benchmarks.md, "Qwen3.5 hybrids
in the native layer stack".
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from nanoserve.model.delta_net_ops import fits_kernel
from nanoserve.model.layer_features import SILU
from nanoserve.model.layer_weights import StackedModel
from nanoserve.model.native_layers import packed_parts, stack_module
from nanoserve.model.parallel import TensorParallelGroup


def hybrid_module() -> ModuleType | None:
    """The compiled `hybrid_layers` extension, or None (see `native_layers.stack_module`)."""
    return stack_module("hybrid_layers")


def build_hybrid_stack(model: StackedModel,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any | None:
    """A hybrid model's layers bound to their caches as one native call, or None where the
    Python layer loop must run (see the top). Asked for by `CpuPagedBackend.layer_stack`, only
    for the fused op table (`forward_plan.py`); `ForwardPlan` binds each step's states to it
    (its `HybridStep`)."""
    arch, features, group = model.arch, model.features, model.group
    shape = arch.linear
    if (shape is None or arch.moe is not None or not fits_kernel(shape)
            or not (isinstance(group, TensorParallelGroup) and group.is_single)
            or features.has_sandwich_norms or features.has_windows
            or features.activation != SILU or features.q_scale != 1.0):
        return None
    native = hybrid_module()
    if native is None:
        return None
    stack = native.HybridStack(arch.num_heads, arch.head_dim, arch.rms_norm_eps, model.norm,
                               shape.num_key_heads, shape.num_value_heads,
                               shape.value_head_dim, shape.v_heads_tiled)
    layer: Any  # a DeltaNetLayer (hybrid_layers.py) or a DecoderLayer (llama.py)
    for index, (layer, (k_cache, v_cache)) in enumerate(zip(model.decoder_layers, kv_caches,
                                                            strict=True)):
        mlp = [packed_parts(layer.gate_up_proj), packed_parts(layer.down_proj)]
        if arch.is_linear(index):
            matmuls = [packed_parts(w) for w in (layer.in_proj, layer.ba_proj, layer.out_proj)]
            if any(m is None for m in (*matmuls, *mlp)):
                return None
            stack.add_delta_layer(layer.input_layernorm, layer.post_attention_layernorm,
                                  *matmuls, *mlp, layer.conv_weight, layer.neg_exp_a,
                                  layer.dt_bias, layer.norm, layer.linear_index)
            continue
        gate = [] if layer.attn_gate_proj is None else packed_parts(layer.attn_gate_proj)
        matmuls = [packed_parts(layer.qkv_proj), gate, packed_parts(layer.o_proj)]
        if any(m is None for m in (*matmuls, *mlp)):
            return None
        stack.add_attention_layer(layer.input_layernorm, layer.post_attention_layernorm,
                                  *matmuls, *mlp, layer.qkv_bias, layer.q_norm, layer.k_norm,
                                  k_cache, v_cache)
    return stack


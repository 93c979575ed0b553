"""Gemma 4's decoder layers in one native call (`csrc/gemma4_layers.cpp`).

What it computes: gemma4_layers.py's `BoundGemma4Layer.forward` over the fused op table, every
layer in turn, then the final norm. The stack makes the Python layer's calls in its order: the
fused kernels through the dispatcher and, where the Python layer runs PyTorch ops (the value
rows' norm, a KV-shared layer's q norm and RoPE, the per-layer input's GELU gate, the residual
adds, the layer scalar), the same ATen ops. So the hidden states and caches are the Python
loop's bit for bit (tests/model/test_gemma4_native.py). Each layer keeps its own head size and
KV heads, window, RoPE table (the local one on windowed layers) and KV layer group; a KV-shared
layer computes q alone and attends its source layer's cache. The per-layer inputs [T, L, P] are
computed in Python before the stack (`per_layer_inputs`, ForwardPlan). It runs where
native_layers.py's stack would (the paged CPU backend, one rank, every projection packed, the
per-layer ones too), never for a model with experts: the MoE block stays in the Python loop.

Why: a Gemma 4 layer makes some 30 op calls from Python, each microseconds of dispatch for a
decode step's few rows. On E2B's shape (the bench's random Q4_0 file, 35 layers; 2 cores, avx2)
a whole decode step took 138 ms with the stack against 156 ms in the Python loop at batch 1,
182 against 211 ms at batch 4 (`bench step --compare-eager`; docs/benchmarks.md, "Gemma 4 in
the native layer stack"). The calls run one after another (each kernel forks and joins its
thread team); a few tokens as one parallel region, as csrc/team_forward.h runs the other
families, is a later step.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from nanoserve.model.kv_groups import kv_layer_groups
from nanoserve.model.layer_weights import StackedModel
from nanoserve.model.native_layers import packed_args, packed_parts, stack_module
from nanoserve.model.parallel import TensorParallelGroup


def gemma4_module() -> ModuleType | None:
    """The compiled `gemma4_layers` extension, or None (see `native_layers.stack_module`)."""
    return stack_module("gemma4_layers")


def build_gemma4_stack(model: StackedModel,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any | None:
    """A Gemma 4 model's layers bound to their caches as one native call, or None where the
    Python layer loop must run (see the top). Asked for by `CpuPagedBackend.layer_stack`, only
    for the fused op table (`forward_plan.py`)."""
    arch, group = model.arch, model.group
    if (arch.gemma4 is None or arch.gemma4.has_moe
            or not (isinstance(group, TensorParallelGroup) and group.is_single)):
        return None
    native = gemma4_module()
    if native is None:
        return None
    stack = native.Gemma4Stack(arch.num_heads, arch.rms_norm_eps, model.norm)
    features, kv_groups = model.features, kv_layer_groups(arch).group_of_layer
    layer: Any  # gemma4_layers.py's Gemma4Layer (LayerWeights' names, and its own)
    for index, (layer, (k_cache, v_cache)) in enumerate(zip(model.decoder_layers, kv_caches,
                                                            strict=True)):
        qkv = packed_parts(layer.qkv_proj)
        matmuls = [packed_args(w) for w in (layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        ple = [packed_args(w) for w in (layer.ple_gate, layer.ple_proj) if w is not None]
        if qkv is None or any(m is None for m in (*matmuls, *ple)):
            return None
        stack.add_layer(
            input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm,
            attn_output_norm=layer.attn_output_norm, mlp_output_norm=layer.mlp_output_norm,
            qkv=qkv, o=matmuls[0], gate_up=matmuls[1], down=matmuls[2], q_norm=layer.q_norm,
            k_norm=layer.k_norm, k_cache=k_cache, v_cache=v_cache,
            ple_gate=ple[0] if ple else None, ple_proj=ple[1] if ple else None,
            ple_norm=layer.ple_norm, layer_scalar=layer.layer_scalar, head_dim=layer.head_dim,
            num_kv_heads=layer.num_kv_heads, owns_kv=layer.owns_kv,
            q_scale=float(layer.head_dim) ** 0.5,  # BoundGemma4Layer's, computed alike
            window=features.windows[index], uses_local_rope=features.uses_local_rope[index],
            kv_group=kv_groups[index])
    return stack

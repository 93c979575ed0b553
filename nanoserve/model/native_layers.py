"""Every decoder layer of a forward in one native call (`csrc/decode_layers.cpp`).

The stack binds a model's weights and caches once and chains the fused path's kernels
(layer_ops.py's fused table) in C++ through the dispatcher (`nanoserve::*` ops), so the hidden
states and caches are the Python loop's bit for bit. Up to 15 tokens a step it runs as one
OpenMP region instead (`csrc/team_forward.h`): each thread takes its share of every matmul and
of attention, and barriers replace ~5 fork/joins a layer, with the same bits again. Every dense
family runs here: the layer's switches (qkv bias, q/k norms, Gemma 3's sandwich norms, GELU-tanh
gate and query scale, each layer's sliding window, RoPE table and KV layer group) are the
model's `LayerFeatures` (layer_features.py), as in the Python loop. It runs where the fused
path would, with paged attention over the cache (`CpuPagedBackend`), one rank and packed
quantized projections (q, k and v may be row parts of two types, as a GGUF file has them);
elsewhere (a MoE model too), and under `--enforce-eager`, the Python loop runs. Gemma 4's
layers have a stack of their own (gemma4_native.py), built with the helpers here.

Why: nine kernel calls a layer from Python cost ~3 ms of a ~9 ms batch-1 step; as one region
that step went from 9.0-9.3 to 6.8-7.8 ms on 2 Zen 1 cores. The same loop under `torch.compile`
(Inductor) gives the same bits but a fork and join per kernel: 1.44x this call's step. Figures:
docs/benchmarks.md, issue 22's sections ("One user's step: the decoder layers as one native
call", "A few tokens' forward as one parallel region", "The alternatives measured"); Gemma 3
270M's batch-1 step, 5.4 ms in the Python loop, is 4.2 ms here ("Gemma 3 in the native layer
stack").
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from nanoserve.model.kv_groups import kv_layer_groups
from nanoserve.model.layer_features import GELU_TANH
from nanoserve.model.layer_weights import StackedModel
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.model.quant_linear import QuantizedWeight
from nanoserve.native import load_kernels

# the kernels whose dispatcher ops the stacks call: loaded (registered) before one is built
STACK_KERNELS = ("quant_matmul", "fused_ops", "paged_attention")


def stack_module(name: str) -> ModuleType | None:
    """A compiled layer stack's extension (`decode_layers`, `gemma4_layers`, `hybrid_layers`),
    or None where it, or a kernel it calls through the dispatcher, cannot build."""
    if any(load_kernels(kernel) is None for kernel in STACK_KERNELS):
        return None
    return load_kernels(name)


def native_module() -> ModuleType | None:
    """The dense families' stack (`decode_layers`), or None (see `stack_module`)."""
    return stack_module("decode_layers")


# packed_matmul's weight arguments: (packed, ggml_type, N, K, wide form or None)
PackedArgs = tuple[torch.Tensor, int, int, int, torch.Tensor | None]


def packed_args(weight: Any) -> PackedArgs | None:
    """packed_matmul's weight arguments, or None for a weight the kernel does not hold."""
    if not (isinstance(weight, QuantizedWeight) and weight.is_packed):
        return None
    return weight.packed_args()


def packed_parts(weight: Any) -> list[PackedArgs] | None:
    """A weight's row parts as packed_matmul's arguments (a ConcatWeight's several: a GGUF
    file's q, k and v in different types), or None where one is not packed."""
    parts = [packed_args(part) for part in getattr(weight, "parts", [weight])]
    return None if any(p is None for p in parts) else parts  # type: ignore[return-value]


def build_layer_stack(model: StackedModel,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any | None:
    """The model's layers bound to their caches as one native call, or None where the Python
    layer loop must run (see the top). Asked for by the paged CPU attention backend
    (`CpuPagedBackend.layer_stack`), whose kernel the stack attends with, and only for the
    fused op table (`forward_plan.py`)."""
    # one rank of the plain group: a group of several (or any other) reduces between layers
    if not (isinstance(model.group, TensorParallelGroup) and model.group.is_single):
        return None
    native = native_module()
    if native is None:
        return None
    arch, features = model.arch, model.features
    stack = native.LayerStack(arch.num_heads, arch.head_dim, arch.rms_norm_eps, model.norm,
                              is_gelu_tanh=features.activation == GELU_TANH,
                              q_scale=features.q_scale)
    kv_groups = kv_layer_groups(arch).group_of_layer
    for index, (layer, (k_cache, v_cache)) in enumerate(zip(model.decoder_layers, kv_caches,
                                                            strict=True)):
        matmuls = [packed_parts(layer.qkv_proj)] + [
            packed_args(w) for w in (layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        if any(m is None for m in matmuls):
            return None
        stack.add_layer(layer.input_layernorm, layer.post_attention_layernorm, *matmuls,
                        layer.qkv_bias, layer.q_norm, layer.k_norm, k_cache, v_cache,
                        attn_output_norm=layer.attn_output_norm,
                        mlp_output_norm=layer.mlp_output_norm, window=features.windows[index],
                        uses_local_rope=features.uses_local_rope[index],
                        kv_group=kv_groups[index])
    return stack

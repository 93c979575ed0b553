"""How a model's layers run: the op table, and whether the attention backend's native layer
stack replaces the Python layer loop. The model runner owns one plan per model; the model holds
its weights and one forward (the layer loop over layers bound to a table).

- The table: the fused C++ kernels where the weights are quantized, in float32 on the CPU and
  the kernels built; else the exact PyTorch ops, held equal to transformers
  (`--quantization none`). Decided at the first forward; tests set `use_fused_ops` to run both
  on one model.
- The stack: with the fused table, the attention backend may offer every layer as one native
  call that attends as it does (`AttentionBackend.layer_stack`; the paged CPU kernel's,
  native_layers.py, Gemma 4's, gemma4_native.py, and a hybrid's, hybrid_native.py, to which
  ForwardPlan binds each step's DeltaNet states). `use_native_layers=False`
  (`--enforce-eager`) keeps the Python loop.

`bench step --compare-eager` toggles `use_native_layers`, and `--compare-compiled` swaps the
stack (`swap_layer_stack`), on the runner's plan.
"""

from __future__ import annotations

from typing import Any

import torch

from nanoserve.model.attention import AttentionBackend, AttentionMetadata
from nanoserve.model.fused_ops import kernels
from nanoserve.model.gemma4_layers import per_layer_inputs
from nanoserve.model.hybrid_layers import HybridStates
from nanoserve.model.kv_groups import kv_layer_groups
from nanoserve.model.layer_ops import EXACT_OPS, OpTable, fused_table
from nanoserve.model.llama import BoundDecoderLayer, CausalLM
from nanoserve.model.rope import StepRotary, mrope_axes
from nanoserve.profiling import scope

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class ForwardPlan:
    """One model's way of running its layers (see the module)."""

    def __init__(self, model: CausalLM, *, use_native_layers: bool = True) -> None:
        self.model = model
        self.use_fused_ops: bool | None = None  # None: decided at the first forward
        self.use_native_layers = use_native_layers
        # by (use_fused_ops, profiled): the layers bound to that table, made once
        self._bound_layers: dict[tuple[bool, bool], tuple[OpTable, list[BoundDecoderLayer]]] = {}
        # (the caches and the backend it was built for, the stack)
        self._layer_stack: tuple[tuple[object, object], Any] | None = None
        self._axes: torch.Tensor | None = None  # multimodal RoPE's axis per column

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches,
                attention: AttentionBackend[Any], meta: AttentionMetadata,
                group_metas: list[AttentionMetadata] | None = None,
                states: HybridStates | None = None,
                images: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden_size].
        `meta` is `attention`'s own, from `attention.build_metadata` for this step (and
        `group_metas` the same for KV layer groups 1.., model/kv_groups.py); `states` a
        hybrid model's DeltaNet states for this step; `images` the rows whose embeddings
        are image features (`CausalLM.embed`). A step with images runs the layer loop: its
        placeholders may attend past themselves (StepInput.key_ends), which the native stack
        does not take. `rope_positions` [3, T]: each token's (t, h, w) position where the
        model's RoPE is multimodal and the step holds an image or follows one (Qwen3.5); the
        step's rows then stand in for the table, read at rows 0..T-1."""
        model = self.model
        assert model.rotary is not None, "weights not loaded: use nanoserve.model.loader"
        table, layers = self._bind_layers()
        if rope_positions is not None:  # multimodal RoPE: this step's rows as the table
            rotary = StepRotary(*model.rotary.rows_3d(rope_positions, self._mrope_axes()))
            positions = torch.arange(len(positions), device=positions.device)
            cos, sin = table.rope_tables(rotary, positions)
        else:
            cos, sin = table.rope_tables(model.rotary, positions)
        rope_local = (table.rope_tables(model.rotary_local, positions)
                      if model.rotary_local is not None and model.features.has_local_rope
                      else None)
        stack = (self._native_stack(kv_caches, attention)
                 if table.is_fused and images is None and rope_positions is None else None)
        if stack is not None and model.is_hybrid:  # its DeltaNet layers read this step's states
            stack = None if states is None else HybridStep(stack, states)
        if stack is not None:
            hidden = model.embed(input_ids)
            # Gemma 4's per-layer inputs [T, L, P], from the embedding before any layer
            ple = (per_layer_inputs(model, input_ids, hidden)
                   if model.embed_tokens_per_layer is not None else None)
            # a scope for `bench step`: a few tokens run as one native region the profiler
            # cannot see into (csrc/team_forward.h)
            with scope("nanoserve.layers"):
                return attention.run_layer_stack(stack, hidden, cos, sin, positions, meta,
                                                 rope_local, group_metas, ple)
        return model.forward(input_ids, positions, kv_caches, attention, meta, table, layers,
                             cos, sin, rope_local, group_metas, states, images)

    def _mrope_axes(self) -> torch.Tensor:
        if self._axes is None:
            self._axes = mrope_axes(self.model.arch).to(self.model.norm.device)
        return self._axes

    def _bind_layers(self) -> tuple[OpTable, list[BoundDecoderLayer]]:
        """This forward's op table and the layers bound to it (bound at its first use)."""
        if self.use_fused_ops is None:
            self.use_fused_ops = self._can_fuse()
        # the profiler check once per step, not per call: the fused table scopes each kernel
        key = (self.use_fused_ops, self.use_fused_ops and torch.autograd._profiler_enabled())
        bound = self._bound_layers.get(key)
        if bound is None:
            table = fused_table(key[1]) if key[0] else EXACT_OPS
            bound = self._bound_layers[key] = (table, [
                layer.bind(table, self.model.group, index, kv_group)
                for index, (layer, kv_group) in enumerate(zip(
                    self.model.decoder_layers, kv_layer_groups(self.model.arch).group_of_layer,
                    strict=True))])
        return bound

    def _native_stack(self, kv_caches: KVCaches, attention: AttentionBackend[Any]) -> Any | None:
        """The layers as one native call over these caches (built at first use), or None."""
        # Under tensor parallelism the Python layer loop runs: the native stack chains every
        # layer in C++ with no all-reduce between them, so it is None for any group but the
        # plain one of one rank. A MoE model's too (Gemma 4's and a hybrid's experts
        # included): the stacks' layers are dense MLPs (gpt-oss's experts too, and its sinks).
        arch = self.model.arch
        if (not self.use_native_layers or arch.moe is not None
                or arch.gpt_oss is not None
                or (arch.gemma4 is not None and arch.gemma4.has_moe)):
            return None
        built = self._layer_stack
        if built is None or built[0][0] is not kv_caches or built[0][1] is not attention:
            built = self._layer_stack = ((kv_caches, attention),
                                         attention.layer_stack(self.model, kv_caches))
        return built[1]

    @property
    def layer_stack(self) -> Any | None:
        """The native layer stack the last fused forward ran, or None."""
        return None if self._layer_stack is None else self._layer_stack[1]

    def swap_layer_stack(self, stack: Any) -> Any:
        """Puts `stack` (anything with the native stack's `forward`) where the built one runs,
        over the same caches; returns the one it replaces. For `bench step
        --compare-compiled`, which times a compiled layer loop in its place."""
        assert self._layer_stack is not None, "a fused forward has built the native stack"
        built_for, previous = self._layer_stack
        self._layer_stack = (built_for, stack)
        return previous

    def _can_fuse(self) -> bool:
        """Quantized matmul weights (any mode but "none") on the CPU in float32, and the kernel
        built: "none" stays the exact plain-PyTorch path."""
        model = self.model
        # an attention layer's (a hybrid has DeltaNet layers too)
        layer = next(x for x in model.decoder_layers if hasattr(x, "qkv_proj"))
        weights = [w for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                               layer.down_proj) if w is not None]  # (none in a MoE layer)
        return (model.norm.device.type == "cpu" and model.norm.dtype == torch.float32
                and model.rotary is not None and model.rotary.cos_table.dtype == torch.float32
                and any(not isinstance(w, torch.Tensor) for w in weights)
                and kernels() is not None)


class HybridStep:
    """The hybrid stack with one step's DeltaNet states bound: what the attention backend's
    `run_layer_stack` calls, with the same arguments as a dense stack's `forward`."""

    __slots__ = ("stack", "states")

    def __init__(self, stack: Any, states: HybridStates) -> None:
        self.stack, self.states = stack, states

    def forward(self, *step: torch.Tensor) -> torch.Tensor:
        """`step`: hidden, cos, sin, positions, cache_index, block_table, context_lens (one
        KV layer group and the global RoPE tables: a hybrid has no other)."""
        assert len(step) == 7, "a hybrid's stack takes one KV group's metadata"
        s = self.states
        return self.stack.forward(*step, s.conv_states, s.ssm_states, s.slots, s.query_start,
                                  s.snapshots)

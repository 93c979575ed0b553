"""What the layer ops (`layer_ops.py`) and the native layer stack (`native_layers.py`) read of
a model: its layers' weights by name, and the few facts that decide whether the stack may run.
`llama.py`'s classes have these attributes; the readers are typed against this protocol, not
those classes, so the model imports them and they never import the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from nanoserve.model.arch import ArchConfig
from nanoserve.model.layer_features import LayerFeatures
from nanoserve.model.parallel import TensorParallelGroup


class LayerWeights(Protocol):
    """One decoder layer's weights (a matmul weight is a float tensor or a quantized one)."""

    @property
    def arch(self) -> ArchConfig: ...
    @property
    def features(self) -> LayerFeatures: ...
    @property
    def input_layernorm(self) -> torch.Tensor: ...
    @property
    def qkv_proj(self) -> Any: ...
    @property
    def qkv_bias(self) -> torch.Tensor | None: ...
    @property
    def o_proj(self) -> Any: ...
    @property
    def q_norm(self) -> torch.Tensor | None: ...
    @property
    def k_norm(self) -> torch.Tensor | None: ...
    @property
    def post_attention_layernorm(self) -> torch.Tensor: ...
    @property
    def gate_up_proj(self) -> Any: ...
    @property
    def down_proj(self) -> Any: ...
    @property
    def attn_output_norm(self) -> torch.Tensor | None: ...  # Gemma's sandwich norms
    @property
    def mlp_output_norm(self) -> torch.Tensor | None: ...


class StackedModel(Protocol):
    """A model whose layers the native stack may run as one call."""

    @property
    def arch(self) -> ArchConfig: ...
    @property
    def features(self) -> LayerFeatures: ...
    @property
    def group(self) -> TensorParallelGroup: ...
    @property
    def norm(self) -> torch.Tensor: ...
    @property
    def decoder_layers(self) -> Sequence[LayerWeights]: ...

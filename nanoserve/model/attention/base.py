"""What every attention backend is: metadata built once per step, a forward every layer calls.

A backend turns the engine's step input (`StepInput`: flat positions and cache rows, each
request's block table and context length) into its own metadata, once per step, and attends
with it in every layer. The model never asks which backend it has; the runner never looks
inside the metadata. Backends (mini-sglang's `attention/base.py`, vLLM's `v1/attention/`):

  sdpa.py       gather + SDPA: decodes batched over gathered blocks, prefill chunks one by one;
                the reference, and the path wherever the kernel cannot run
  cpu_paged.py  the C++ kernel that reads the cache where it lies (CPU; float32, float16 and
                int8 caches): every token of a step attended as a decode
  selector.py   which one runs, from the device and the cache's dtype

Every backend takes attention sinks (gpt-oss): an optional logit per query head that joins
that head's softmax denominator once per query, with no value vector.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from nanoserve.model.layer_weights import StackedModel
    from nanoserve.protocol import StepInput


@dataclass
class AttentionMetadata:
    """What every backend's metadata holds: where this step's keys and values are written."""

    cache_index: torch.Tensor  # [T] int64, a row of every head's plane of the cache

    @property
    def reads_new_kv(self) -> bool:
        """Whether `forward` reads this step's k and v themselves, not only the cache (where
        it does not, the fused layer skips making their views)."""
        return False


MetadataT = TypeVar("MetadataT", bound=AttentionMetadata)


class AttentionBackend(ABC, Generic[MetadataT]):
    """Attention over the paged KV cache for a flat batch of decodes and runs of tokens."""

    def __init__(self, *, block_size: int, num_kv_heads: int, num_blocks: int,
                 device: torch.device) -> None:
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.num_blocks = num_blocks
        self.device = device

    @abstractmethod
    def build_metadata(self, step: StepInput) -> MetadataT:
        """This step's metadata, read by every layer: built once, before the forward."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: MetadataT,
                stored: bool = False, window: int = 0, *,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's keys and values into the cache, then attend: q [T, H, D], k and v
        [T, Hkv, D], caches [Hkv, num_blocks, block_size, D] -> [T, H * D].

        `stored`: the caller wrote them already (both op tables do, in rope_store); k and v
        are then read only where `meta.reads_new_kv`, and may be None elsewhere. `window` > 0:
        each token attends only the last `window` keys up to its own (a sliding-window
        layer: key j for the token at position p when p - window < j <= p). `sinks` [H]
        float32: head h's softmax denominator also holds exp(sinks[h]), once per query
        (transformers' eager gpt-oss attention); None: no sinks."""

    def layer_stack(self, model: StackedModel,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> Any | None:
        """Every layer of `model` over `kv_caches` as one native call that attends as this
        backend does, where this backend has one (and the model allows it); None: the layers
        run one at a time and call `forward`. Asked only for the fused op table."""
        return None

    def run_layer_stack(self, stack: Any, hidden: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, positions: torch.Tensor, meta: MetadataT,
                        rope_local: tuple[torch.Tensor, torch.Tensor] | None = None,
                        group_metas: list[MetadataT] | None = None,
                        per_layer_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """`stack` (from `layer_stack`) over this step: the final normed hidden states.
        `rope_local`: the windowed layers' own cos and sin (Gemma 3); `group_metas`: the
        metadata of KV layer groups 1.. (model/kv_groups.py), as the layer loop takes them;
        `per_layer_inputs`: Gemma 4's [T, L, P] (gemma4_layers.py), where the model has them."""
        raise NotImplementedError(f"{type(self).__name__} has no layer stack")

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

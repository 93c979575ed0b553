"""Runs one forward pass over a step's flat batch (a `StepInput`), returns the sampled rows'
logits.

The step input puts every scheduled token of every request into one batch: decodes first (so
attention can take them all at once), then runs of tokens (prefill chunks, decodes with draft
tokens). Logits are computed only for the rows that sample. The runner sees no request or
scheduler: only the step's arrays.

The KV cache it allocates holds the model's dtype or, with `--kv-cache-dtype float16` (the
default on the CPU with quantized weights), float16: half the bytes, so twice the tokens in the
same memory and half the reads of decode attention, which is memory-bound (figures in
model/attention/cpu_paged.py). Rounding keys and values to float16 costs far less perplexity
than quantized weights do (docs/benchmarks.md), which is why "auto" pairs the two; exact
weights keep an exact cache.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np
import torch

from nanoserve.config import GiB
from nanoserve.engine.image_encoder import ImageEncoder
from nanoserve.engine.state_pool import StatePool
from nanoserve.model.arch import ArchConfig
from nanoserve.model.attention import (
    cache_row_elements,
    can_read_cache_in_place,
    select_attention_backend,
)
from nanoserve.model.forward_plan import ForwardPlan
from nanoserve.model.kv_groups import kv_layer_groups
from nanoserve.model.llama import CausalLM
from nanoserve.model.weight_arena import hugepage_buffer
from nanoserve.protocol import StepInput

KV_CACHE_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


def resolve_kv_cache_dtype(choice: str, quantization: str, device: torch.device,
                           model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for `--kv-cache-dtype` `choice`. "auto" is float16 on the CPU
    when the weights are quantized (`quantization`, the resolved mode, is not "none") and the
    decode kernel that reads float16 is built; else `model_dtype`, so the exact path stays
    exact and CUDA keeps its dtype. An int8 cache is read only by the CPU kernel."""
    if choice == "int8" and not can_read_cache_in_place(device, torch.int8):
        why = "is not built here" if device.type == "cpu" else "runs only on the CPU"
        raise ValueError(f"kv_cache_dtype='int8' needs the CPU attention kernel, which {why} "
                         f"(device {device}); use float16 or float32")
    if choice != "auto":
        return KV_CACHE_TORCH_DTYPES[choice]
    if (device.type == "cpu" and quantization != "none"
            and can_read_cache_in_place(device, torch.float16)):
        return torch.float16
    return model_dtype


# Touching the cache's pages at start-up costs ~1.5 s per GiB on a small VM; 1 GiB holds
# ~23,000 tokens of the default model in float32 (~46,000 in the float16 cache that quantized
# weights get), more than a CPU serves at once. A model whose `max_num_seqs` sequences at its
# full context fit in less (a small model with a short context) gets only that: the blocks past
# it could hold nothing but evicted prefixes (measured: the tests' tiny Llama's engine builds in
# 0.3 s against 0.5-1.1 s with 1 GiB).
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB
GPU_MEMORY_FRACTION = 0.9


def kv_cache_num_blocks(budget: int | None, arch: ArchConfig, block_size: int,
                        dtype: torch.dtype, device: torch.device, *, max_num_seqs: int,
                        context_len: int, num_draft_layers: int = 0) -> int:
    """The blocks a cache of `dtype` gets from `budget` bytes (None: on the CPU 1 GiB, or the
    blocks `max_num_seqs` sequences of `context_len` tokens fill if fewer; on a GPU 90 % of
    its free memory). A block holds one KV layer group's layers (model/kv_groups.py), and
    `num_draft_layers` more (an MTP head's: engine/mtp_drafter.py)."""
    block_bytes = kv_bytes_per_block(arch, block_size, dtype, num_draft_layers)
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * GPU_MEMORY_FRACTION)
        else:
            groups = kv_layer_groups(arch).num_groups
            needed = max_num_seqs * -(-context_len // block_size) * groups
            return max(1, min(DEFAULT_CPU_KV_CACHE_BYTES // block_bytes, needed))
    return max(1, budget // block_bytes)


def kv_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype,
                       num_draft_layers: int = 0) -> int:
    """Bytes of one block's keys and values over a KV layer group's layers (every layer,
    for a model of one group), in a cache of `dtype`; where groups' rows differ in shape
    (Gemma 4) a block holds rows of each shape (model/kv_groups.py), and costs them all.
    `num_draft_layers`: an MTP head's layers, whose rows every block holds too."""
    element_size = torch.empty((), dtype=dtype).element_size()
    groups = kv_layer_groups(arch)
    return sum(2 * (groups.group_size + num_draft_layers) * block_size * num_kv_heads
               * cache_row_elements(head_dim, dtype) * element_size
               for num_kv_heads, head_dim in groups.distinct_shapes(
                   (arch.num_kv_heads, arch.head_dim)))


class ModelRunner:
    """Owns the model and the KV cache tensors; one `execute` per engine step."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, *,
                 use_native_layers: bool = True, num_state_slots: int = 0,
                 ssm_dtype: torch.dtype = torch.float32) -> None:
        """`use_native_layers`: let the attention backend's native layer stack run the
        layers where it can (False: `--enforce-eager`, the Python layer loop);
        `num_state_slots`: a hybrid model's DeltaNet state slots and `ssm_dtype` their
        recurrent states' element type (engine/state_pool.py)."""
        arch = model.arch
        self.model = model
        # how the layers run: the op table and the native stack (model/forward_plan.py)
        self.plan = ForwardPlan(model, use_native_layers=use_native_layers)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = arch.num_kv_heads
        self.device = device
        # Zero-filled, so masked-out (stale or padding) cache entries are always finite; and
        # touched now, at start-up: a first write to a page during a step costs a page fault.
        # A tensor pair per layer of a KV layer group, shared by the groups (each block
        # belongs to one group at a time), per row shape (Gemma 4's two): layer l uses its
        # shape's pair of its slot (a KV-shared layer, its source layer's)
        self.kv_groups = kv_layer_groups(arch)
        default_shape = (arch.num_kv_heads, arch.head_dim)
        pairs = {(heads, dim): [
            (_zeros(shape, dtype, device), _zeros(shape, dtype, device))
            for _ in range(self.kv_groups.group_size)]
            for heads, dim in self.kv_groups.distinct_shapes(default_shape)
            # see model/attention/kv_rows.py
            for shape in [(heads, num_blocks, block_size, cache_row_elements(dim, dtype))]}
        self.kv_caches = [pairs[shape][j] for shape, j in zip(
            self.kv_groups.shape_of_layer(default_shape), self.kv_groups.slot_of_layer,
            strict=True)]
        self.kv_slot_pairs = [pair for shape_pairs in pairs.values() for pair in shape_pairs]
        # the C++ kernel where it reads this cache in place, else gather + SDPA
        self.attention = select_attention_backend(device, dtype, block_size=block_size,
                                                  num_kv_heads=arch.num_kv_heads,
                                                  num_blocks=num_blocks)
        self.state_pool = (StatePool(arch, num_state_slots, device, ssm_dtype)
                           if model.is_hybrid else None)
        # a vision model's tower, run once per distinct image (engine/image_encoder.py)
        self.image_encoder = (None if model.vision is None else ImageEncoder(
            model.vision, model.normalize_image, device, dtype_of(model)))

    @torch.inference_mode()
    def execute(self, step: StepInput) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits [S, vocab] (float32) of the step's sampled rows, in their order; and, for
        each of `step.prompt_logprobs`, the logits at its rows (row j predicts its target j)."""
        logits, prompt_logits, _ = self.execute_step(step)
        return logits, prompt_logits

    @torch.inference_mode()
    def execute_step(self, step: StepInput
                     ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """`execute`'s two results, and the final normed hidden states [T, hidden] that
        pooling requests are pooled from (the worker's Pooler)."""
        meta = self.attention.build_metadata(step)
        group_metas = [self.attention.build_metadata(msgspec.structs.replace(
            step, block_table=table, cache_index=rows))
            for table, rows in zip(step.group_block_tables, step.group_cache_index, strict=True)]
        # (asked for only where there are groups: wrappers of the plan take the plain call)
        extra: dict[str, Any] = {"group_metas": group_metas} if group_metas else {}
        if self.state_pool is not None:
            extra["states"] = self.state_pool.step_states(step)
        if step.images:
            if self.image_encoder is None:
                raise ValueError("a step with images for a model without a vision tower")
            extra["images"] = self.image_encoder.step_rows(step.images)
        if step.rope_positions.shape[1]:
            extra["rope_positions"] = self._tensor(step.rope_positions)
        hidden = self.plan.forward(self._tensor(step.token_ids), self._tensor(step.positions),
                                   self.kv_caches, self.attention, meta, **extra)  # [T, hidden]
        prompt_logits = [
            self.model.compute_logits(
                hidden[entry.first_row : entry.first_row + len(entry.target_token_ids)])
            for entry in step.prompt_logprobs]
        if not len(step.logits_rows):  # only partial prefill chunks (or pooling) this step
            empty = hidden.new_empty(0, self.model.arch.vocab_size, dtype=torch.float32)
            return empty, prompt_logits, hidden
        rows = self._tensor(step.logits_rows)
        return self.model.compute_logits(hidden.index_select(0, rows)), prompt_logits, hidden

    # -- one block's bytes, for the prefix cache's disk tier (engine/kv_disk.py) --------------
    @property
    def kv_block_nbytes(self) -> int:
        """The bytes of one block: its rows in every cache tensor of a KV layer group."""
        return sum(2 * k[:, 0].numel() * k.element_size() for k, _ in self.kv_slot_pairs)

    def kv_block_layout(self) -> str:
        """What the block bytes mean: the cache tensors' type and shapes but the block count."""
        k = self.kv_slot_pairs[0][0]
        shapes = sorted({(*t.shape[:1], *t.shape[2:]) for t, _ in self.kv_slot_pairs})
        shape = shapes[0] if len(shapes) == 1 else shapes
        return f"{k.dtype} {shape} x {2 * len(self.kv_slot_pairs)} {self.kv_groups}"

    def read_kv_block(self, block_id: int) -> bytes:
        """Block `block_id`'s keys and values, every tensor of the group, as stored."""
        parts = [t[:, block_id].contiguous().view(torch.uint8).reshape(-1)
                 for pair in self.kv_slot_pairs for t in pair]
        return torch.cat(parts).cpu().numpy().tobytes()

    def write_kv_block(self, block_id: int, payload: bytes) -> None:
        """The inverse of `read_kv_block`: `payload`'s bytes into block `block_id`."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for pair in self.kv_slot_pairs:
            for tensor in pair:
                rows = tensor[:, block_id]
                size = rows.numel() * rows.element_size()
                rows.copy_(data[offset : offset + size].view(tensor.dtype).view(rows.shape))
                offset += size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] float32: the LM head (a "score" request's rows)."""
        return self.model.compute_logits(hidden)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)


def dtype_of(model: CausalLM) -> torch.dtype:
    """The model's float dtype (its final norm's)."""
    return model.norm.dtype


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor; on the CPU on huge pages (model/weight_arena.py: decode
    attention reads every request's rows of every layer each step), touched now."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return hugepage_buffer(num_bytes).view(dtype).view(shape).zero_()

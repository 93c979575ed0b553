"""`--quantization`: each mode loads real checkpoints and computes close to the exact path.

The kernels themselves are held to gguf's dequantization in test_quant_kernels.py; here whole
models are: a tiny Llama as GGUF (one block type, and q/k/v in different types) and as
safetensors, every mode's prefill logits against `none`'s on the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from helpers import make_engine
from test_equivalence import prefill_logits
from test_loading import PROMPT, write_gguf

from nanoserve.config import ModelConfig
from nanoserve.engine_args import EngineArgs
from nanoserve.model.quant_linear import QuantizedWeight, kernels
from nanoserve.model.quantization import ConcatWeight, Fp16Weight, resolve_mode

Q8_0, Q4_0 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
Q5_0, Q5_1 = gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1


def relative_error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return ((ours - exact).norm() / exact.norm()).item()


def logits(model: Path, quantization: str) -> tuple[torch.Tensor, Any]:
    engine = make_engine(model, quantization=quantization)
    with torch.inference_mode():
        return prefill_logits(engine, PROMPT), engine.runner.model


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quant") / "tiny-q8.gguf"
    return write_gguf(tiny_model_dir("llama"), out, Q8_0, with_rope_factors=False)


def test_gguf_mode_keeps_the_blocks_and_computes_close_to_exact(tiny_gguf: Path) -> None:
    exact, exact_model = logits(tiny_gguf, "none")
    ours, model = logits(tiny_gguf, "auto")  # auto = gguf for a GGUF file on the CPU
    layer = model.layers[0]
    assert isinstance(layer.qkv_proj, QuantizedWeight) and layer.qkv_proj.ggml_type == 8
    assert model.lm_head is model.embed_tokens  # tied: the head multiplies the same blocks
    assert isinstance(exact_model.layers[0].qkv_proj, torch.Tensor)
    # int8 activations against float32: ~5e-3 of the norm per matmul, compounded by layers
    assert relative_error(ours, exact) < 3e-2
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean() > 0.8


def test_q_k_v_in_different_types_stay_quantized(tiny_model_dir, tmp_path: Path) -> None:
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "mixed.gguf", Q8_0,
                      with_rope_factors=False, qtype_of={"attn_v": Q4_0})
    exact, _ = logits(path, "none")
    ours, model = logits(path, "gguf")
    qkv = model.layers[0].qkv_proj
    if kernels() is not None:
        assert isinstance(qkv, ConcatWeight)
        assert [p.ggml_type for p in qkv.parts] == [8, 2]  # q+k fused, v on its own
    assert relative_error(ours, exact) < 5e-2


def test_5_bit_weights_stay_quantized_up_to_the_lm_head(tiny_model_dir, tmp_path: Path) -> None:
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "q5.gguf", Q5_0,
                      with_rope_factors=False, qtype_of={"attn_v": Q5_1})
    exact, _ = logits(path, "none")
    ours, model = logits(path, "gguf")
    if kernels() is not None:
        layer = model.layers[0]
        assert isinstance(layer.qkv_proj, ConcatWeight)
        assert [p.ggml_type for p in layer.qkv_proj.parts] == [6, 7]  # Q5_0 q+k, Q5_1 v
        for weight in (layer.o_proj, layer.gate_up_proj, layer.down_proj, model.lm_head):
            assert isinstance(weight, QuantizedWeight) and weight.is_packed
            assert weight.ggml_type == 6
        # tied: the head multiplies the embedding's blocks, beside a wide form of its own
        assert torch.equal(model.lm_head.data, model.embed_tokens.data)
        assert model.lm_head.wide is not None and model.embed_tokens.wide is None
    assert relative_error(ours, exact) < 5e-2


@pytest.mark.parametrize(("mode", "weight_type", "tolerance"), [
    ("int8", QuantizedWeight, 3e-2),  # Q8_0 weights and int8 activations
    ("fp16", Fp16Weight, 2e-3),  # f16 weights, float32 arithmetic
])
def test_safetensors_model_quantized_at_load(tiny_model_dir, mode: str, weight_type: type,
                                             tolerance: float) -> None:
    path = tiny_model_dir("llama")
    exact, _ = logits(path, "none")
    ours, model = logits(path, mode)
    assert isinstance(model.layers[0].gate_up_proj, weight_type)
    assert relative_error(ours, exact) < tolerance


def test_modes_that_cannot_run_are_refused(tiny_model_dir) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mode("auto", True, cpu) == "gguf"
    assert resolve_mode("auto", False, cpu) == "none"
    assert resolve_mode("auto", True, cuda) == "none"
    with pytest.raises(ValueError, match=r"needs a \.gguf model file"):
        make_engine(tiny_model_dir("llama"), quantization="gguf")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_mode("int8", False, cuda)
    with pytest.raises(ValueError, match=r"quantization='q3'.*'auto', 'gguf', 'int8'"):
        ModelConfig(quantization="q3")


def test_quantization_flag() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "fp16"]))
    assert args.to_config().model.quantization == "fp16"
    assert EngineArgs().to_config().model.quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q3"])

"""MoE GGUF files (`qwen3moe`, `qwen2moe`): stacked experts split per expert, read exactly
(`--quantization none` equals transformers on the same weights) and quantized (the experts'
own Q8_0 / Q4_0 blocks through the int8 kernel); and the default model upcycled to a qwen2moe
whose every expert is its dense MLP (moe_checkpoints.py), equal to it token for token on the
quantized path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from helpers import hf_greedy, hf_model, make_engine, run_to_completion
from moe_checkpoints import (
    UPCYCLED_EXPERTS,
    UPCYCLED_TOP_K,
    upcycle_default_model,
    write_tiny_moe,
    write_tiny_moe_gguf,
)
from test_equivalence import assert_logits_match, prefill_logits, random_prompts

import nanoserve.model.moe as moe_module
from nanoserve.model.fused_ops import kernels
from nanoserve.model.loader import load_arch, load_model
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.model.quant_linear import QuantizedWeight
from nanoserve.sampling_params import SamplingParams

Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(kernels() is None, reason="quantized kernels unavailable")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any
              ) -> dict[str, Path]:
    return {kind: write_tiny_moe(kind, tmp_path_factory.mktemp(kind), default_tokenizer)
            for kind in ("qwen3_moe", "qwen2_moe")}


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_f32_gguf_reads_the_experts_exactly(kind: str, tiny_dirs: dict[str, Path],
                                            tmp_path: Path) -> None:
    """The file's shape is the checkpoint's (its dense layer too: a layer without a router),
    and with exact weights its logits and greedy tokens are transformers' on the checkpoint."""
    src = tiny_dirs[kind]
    path = write_tiny_moe_gguf(src, tmp_path / f"{kind}.gguf")
    assert load_arch(str(path)).moe == load_arch(str(src)).moe
    reference = hf_model(src)
    engine = make_engine(path)
    prompts = random_prompts(reference.config.vocab_size, seed=4)
    assert_logits_match(engine, reference, [prompts["p7"], prompts["p100"]])
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    chosen = {k: prompts[k] for k in ("p1", "p17", "p64")}
    got = run_to_completion(engine, chosen, greedy)
    assert got == {k: hf_greedy(reference, ids, 8) for k, ids in chosen.items()}


@needs_kernel
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_quantized_experts_run_through_the_int8_kernel(qtype: Q, tiny_dirs: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """The default path for a GGUF file: every expert a QuantizedWeight of the file's own
    blocks; logits within the activations' int8 rounding of the same file read exactly
    (measured ~1.2% of the norm for these 64-wide layers), and batching changes no token."""
    path = write_tiny_moe_gguf(tiny_dirs["qwen3_moe"], tmp_path / f"{qtype.name}.gguf", qtype)
    engine = make_engine(path, quantization="gguf", max_num_batched_tokens=48)
    block = engine.runner.model.decoder_layers[0].moe
    assert block is not None
    assert all(isinstance(w, QuantizedWeight) and w.ggml_type == qtype
               for mlp in block.experts for w in (mlp.gate_up_proj, mlp.down_proj))
    prompts = random_prompts(engine.model_info.arch.vocab_size, seed=5)
    quantized = prefill_logits(engine, prompts["p100"])
    exact = prefill_logits(make_engine(path), prompts["p100"])
    assert ((quantized - exact).norm() / exact.norm()).item() < 3e-2
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    chosen = {k: prompts[k] for k in ("p1", "p7", "p33", "p100")}
    together = run_to_completion(engine, chosen, greedy)
    assert engine.runner.plan.use_fused_ops and engine.runner.plan.layer_stack is None
    for k, ids in chosen.items():
        assert run_to_completion(engine, {k: ids}, greedy)[k] == together[k], k


def test_experts_that_do_not_split_in_whole_blocks_are_refused_by_name(
        tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Each expert's down projection has 32 columns, one Q8_0 block: two ranks cannot split
    it in whole blocks, and the error names the expert's tensor."""
    path = write_tiny_moe_gguf(tiny_dirs["qwen3_moe"], tmp_path / "q8.gguf", Q.Q8_0)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.0.down_proj.weight': "
                                         r"its columns \(32\) does not split into 2 equal "
                                         r"parts in whole blocks of 32"):
        load_model(str(path), CPU, torch.float32, 64, "gguf", TensorParallelGroup(1, 2))


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return upcycle_default_model(tmp_path_factory.mktemp("upcycled") / "smollm2-moe.gguf")


@pytest.mark.slow
@needs_kernel
def test_upcycled_default_model_equals_the_dense_one_token_for_token(
        upcycled: Path, default_tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The qwen2moe file computes exactly what SmolLM2 does (see `upcycle_default_model`): a
    batch of prompts, chunked beside decodes, gives the dense model's greedy tokens on the
    quantized path, while its router really spreads the tokens over the experts (weights
    exactly 1 and 0)."""
    chosen: list[torch.Tensor] = []
    weights_seen: list[torch.Tensor] = []
    route = moe_module.route

    def recording(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(*args)
        chosen.append(ids[:, 0])
        weights_seen.append(weights)
        return weights, ids

    monkeypatch.setattr(moe_module, "route", recording)
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a land far away,", "1, 2, 3, 4,",
             "Water boils at a temperature of"]
    prompts = {f"p{i}": default_tokenizer.encode(text) for i, text in enumerate(texts)}
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = []
    for model in (None, upcycled):
        engine = make_engine(model, quantization="gguf", max_num_batched_tokens=24)
        outputs.append(run_to_completion(engine, prompts, greedy))
    assert engine.model_info.arch.moe is not None
    assert engine.runner.plan.use_fused_ops and engine.runner.plan.layer_stack is None
    dense, moe = outputs
    assert moe == dense
    first_choices = torch.cat(chosen)
    assert len(first_choices.unique()) == UPCYCLED_EXPERTS  # every expert led some token
    weights = torch.cat(weights_seen)
    assert weights.shape[1] == UPCYCLED_TOP_K
    assert torch.equal(weights, torch.tensor([1.0, 0.0]).expand_as(weights))

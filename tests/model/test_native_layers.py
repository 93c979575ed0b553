"""native_layers.py's one-call layer stack against the Python layer loop over the same fused
kernels: the same compiled kernels in the same order, so every step's hidden states and every
cache entry are equal bit for bit (not merely close), on the tiny Llama (tied head), Qwen2 (qkv
bias) and Qwen3 (q/k norm) checkpoints quantized to int8 at load, through steps that mix
decodes with chunked prefills."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import run_to_completion
from test_fused_model import GREEDY, mixes_decodes_and_prefills, prompts, small_engine

from nanoserve.model.attention import AttentionBackend, AttentionMetadata
from nanoserve.model.native_layers import native_module
from nanoserve.sampling_params import SamplingParams

needs_native = pytest.mark.skipif(native_module() is None,
                                  reason="the decode_layers extension is unavailable")


class NativeAndPython:
    """Wraps a model's forward: each step runs the Python layer loop, then the native stack
    from the same cache state; records whether hidden states and caches were identical."""

    def __init__(self, model: Any) -> None:
        self.model, self.forward = model, model.forward
        self.identical: list[bool] = []
        self.num_mixed_steps = 0
        model.forward = self

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 attention: AttentionBackend[Any], meta: AttentionMetadata) -> torch.Tensor:
        before = [(k.clone(), v.clone()) for k, v in kv_caches]
        self.model.use_native_layers = False
        python = self.forward(input_ids, positions, kv_caches, attention, meta)
        python_caches = [(k.clone(), v.clone()) for k, v in kv_caches]
        for (k, v), (k0, v0) in zip(kv_caches, before, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        self.model.use_native_layers = True
        native = self.forward(input_ids, positions, kv_caches, attention, meta)
        assert self.model._layer_stack[1] is not None, "the native stack should run here"
        same_caches = all(torch.equal(ours, theirs)
                          for pair, python_pair in zip(kv_caches, python_caches, strict=True)
                          for ours, theirs in zip(pair, python_pair, strict=True))
        self.identical.append(torch.equal(native, python) and same_caches)
        self.num_mixed_steps += mixes_decodes_and_prefills(meta)
        return native


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_native_stack_equals_the_python_loop_bit_for_bit(family: str,
                                                             tiny_model_dir: Any) -> None:
    engine = small_engine(tiny_model_dir(family), "int8")
    generator = torch.Generator().manual_seed(0)
    for layer in engine.loaded.model.decoder_layers:  # the checkpoint's biases are all zero
        if layer.qkv_bias is not None:
            layer.qkv_bias.copy_(0.05 * torch.randn(layer.qkv_bias.shape, generator=generator))
    both = NativeAndPython(engine.loaded.model)
    run_to_completion(engine, prompts(2), GREEDY)
    assert both.num_mixed_steps > 0, "some steps should mix decodes with prefill chunks"
    assert both.identical and all(both.identical)


@needs_native
def test_the_stack_runs_only_where_the_fused_path_does(tiny_model_dir: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for quantization, runs in (("int8", True), ("none", False)):
        engine = small_engine(tiny_model_dir("llama"), quantization)
        run_to_completion(engine, {"a": [5, 6, 7]}, params)
        stack = engine.loaded.model._layer_stack
        assert (stack is not None and stack[1] is not None) is runs, quantization


@needs_native
def test_enforce_eager_keeps_the_python_loop_with_the_same_outputs(tiny_model_dir: Any) -> None:
    """`--enforce-eager` (EngineArgs) runs the Python layer loop; the tokens are the same."""
    from nanoserve.engine.core import EngineCore
    from nanoserve.engine_args import EngineArgs

    outputs, stacks = {}, {}
    for eager in (False, True):
        args = EngineArgs(model=str(tiny_model_dir("qwen3")), device="cpu",
                          quantization="int8", kv_cache_memory_gb=0.0625, enforce_eager=eager)
        engine = EngineCore(args.to_config())
        outputs[eager] = run_to_completion(engine, prompts(3), GREEDY)
        stacks[eager] = engine.loaded.model._layer_stack
    assert stacks[True] is None and stacks[False] is not None and stacks[False][1] is not None
    assert outputs[True] == outputs[False]

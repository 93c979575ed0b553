"""native_layers.py's one-call layer stack against the Python layer loop over the same fused
kernels: the same compiled kernels in the same order, so every step's hidden states and every
cache entry are equal bit for bit (not merely close), on the tiny Llama (tied head), Qwen2 (qkv
bias) and Qwen3 (q/k norm) checkpoints quantized to int8 at load, through steps that mix
decodes with chunked prefills."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import run_to_completion
from test_fused_model import GREEDY, TwoPaths, prompts, small_engine
from test_loading import write_gguf

from nanoserve.model.native_layers import native_module

needs_native = pytest.mark.skipif(native_module() is None,
                                  reason="the decode_layers extension is unavailable")


class NativeAndPython(TwoPaths):
    """The Python layer loop, then the native stack: whether hidden states and caches were
    identical."""

    flag = "use_native_layers"

    def __init__(self, plan: Any) -> None:
        super().__init__(plan)
        self.identical: list[bool] = []

    def record(self, off: torch.Tensor, off_caches: list[tuple[torch.Tensor, torch.Tensor]],
               on: torch.Tensor, on_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        assert self.plan._layer_stack[1] is not None, "the native stack should run here"
        same_caches = all(torch.equal(ours, theirs)
                          for pair, python_pair in zip(on_caches, off_caches, strict=True)
                          for ours, theirs in zip(pair, python_pair, strict=True))
        self.identical.append(torch.equal(on, off) and same_caches)


@needs_native
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_native_stack_equals_the_python_loop_bit_for_bit(family: str,
                                                             tiny_model_dir: Any) -> None:
    engine = small_engine(tiny_model_dir(family), "int8")
    generator = torch.Generator().manual_seed(0)
    for layer in engine.runner.model.decoder_layers:  # the checkpoint's biases are all zero
        if layer.qkv_bias is not None:
            layer.qkv_bias.copy_(0.05 * torch.randn(layer.qkv_bias.shape, generator=generator))
    both = NativeAndPython(engine.runner.plan)
    run_to_completion(engine, prompts(2), GREEDY)
    assert both.num_mixed_steps > 0, "some steps should mix decodes with prefill chunks"
    assert both.identical and all(both.identical)


@needs_native
@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1"])
def test_the_native_stack_runs_5_bit_weights_as_the_python_loop(qtype: str, tiny_model_dir: Any,
                                                                 tmp_path: Path) -> None:
    """A GGUF file's own 5-bit blocks (`--quantization gguf`): the one-region stack and the
    dispatcher path take them as they take the other types, bit for bit."""
    ggml_type = GGMLQuantizationType[qtype]
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "q5.gguf", ggml_type,
                      with_rope_factors=False)
    engine = small_engine(path, "gguf")
    assert engine.runner.model.decoder_layers[0].down_proj.ggml_type == ggml_type
    both = NativeAndPython(engine.runner.plan)
    run_to_completion(engine, prompts(2), GREEDY)
    assert both.num_mixed_steps > 0
    assert both.identical and all(both.identical)


@needs_native
def test_enforce_eager_keeps_the_python_loop_with_the_same_outputs(tiny_model_dir: Any) -> None:
    """`--enforce-eager` (EngineArgs) runs the Python layer loop; the tokens are the same."""
    from nanoserve.engine.build import build_engine_core
    from nanoserve.engine_args import EngineArgs

    outputs, stacks = {}, {}
    for eager in (False, True):
        args = EngineArgs(model=str(tiny_model_dir("qwen3")), device="cpu",
                          quantization="int8", kv_cache_memory_gb=0.0625, enforce_eager=eager)
        engine = build_engine_core(args.to_config())
        outputs[eager] = run_to_completion(engine, prompts(3), GREEDY)
        stacks[eager] = engine.runner.plan._layer_stack
    assert stacks[True] is None and stacks[False] is not None and stacks[False][1] is not None
    assert outputs[True] == outputs[False]


@pytest.fixture(scope="module")
def grouped_query_model_dir(tmp_path_factory: pytest.TempPathFactory,
                            default_tokenizer: Any) -> Callable[[int], Path]:
    """queries per KV head -> a tiny Llama with one KV head serving that many query heads. The
    default model's three KV heads each serve three: at one token a step, two threads then
    divide a group's heads between them (three: exactly; four: not, so by whole groups)."""
    import transformers

    made: dict[int, Path] = {}

    def make(group: int) -> Path:
        if group not in made:
            config = transformers.LlamaConfig(
                vocab_size=49152, hidden_size=32 * group, intermediate_size=160,
                num_hidden_layers=2, num_attention_heads=group, num_key_value_heads=1,
                max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2, initializer_range=0.05, tie_word_embeddings=True)
            torch.manual_seed(1234)
            made[group] = path = tmp_path_factory.mktemp(f"tiny-gqa{group}")
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
            default_tokenizer.save_pretrained(path)
        return made[group]

    return make


@needs_native
@pytest.mark.parametrize("group", [3, 4])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize(("prompt_lengths", "budget"),
                         [((40, 90, 3), 256), ((530, 700), 256), ((30, 600), 12)],
                         ids=["whole", "split", "runs"])
def test_few_token_steps_equal_the_python_loop_on_every_cache(
        group: int, kv_cache_dtype: str, prompt_lengths: tuple[int, ...], budget: int,
        grouped_query_model_dir: Callable[[int], Path]) -> None:
    """A few tokens a step run the stack as one parallel region (csrc/team_forward.h), where
    each thread attends some query heads of a KV head's group, or whole groups, or, past 512
    tokens of context, some partitions merged by log-sum-exp; and where a prompt's chunk of a
    few rows rides beside decodes (a budget of 12 tokens), its rows in blocks against shared
    tiles of keys (run_attend.h): those steps, on each cache type, equal the Python loop's bit
    for bit."""
    from nanoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from nanoserve.engine.build import build_engine_core

    engine = build_engine_core(EngineConfig(
        model=ModelConfig(model=str(grouped_query_model_dir(group)), device="cpu",
                          dtype="float32", quantization="int8"),
        cache=CacheConfig(num_blocks=96, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget)))
    rng = random.Random(1)
    step_prompts = {f"p{n}": [rng.randrange(3, 49152) for _ in range(n)] for n in prompt_lengths}
    both = NativeAndPython(engine.runner.plan)
    outputs = run_to_completion(engine, step_prompts, GREEDY)
    assert all(len(ids) == GREEDY.max_tokens for ids in outputs.values())
    assert both.identical and all(both.identical)

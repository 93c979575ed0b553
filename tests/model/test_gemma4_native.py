"""gemma4_native.py's one-call stack against the Python layer loop over the same fused kernels
(and, where the Python layer runs PyTorch ops, the same ATen ops): every step's final hidden
states and every cache entry equal bit for bit, on tiny Gemma 4 GGUF files in Q8_0 (llama.cpp's
layout, `--quantization gguf`): the E2B-like one (per-layer inputs 32 wide, so the projection
is a whole Q8_0 block; KV-shared layers reading layers 1 and 2; a double-wide MLP; windows of
4 with their own RoPE base; three KV groups; head sizes 16 and 32) and the 31B-like dense one
(K = V global layers with fewer KV heads), through steps of one token, of several decodes and
of prefill chunks beside them, far past the window; greedy tokens with the stack equal those
under `--enforce-eager`; a model with experts, or a per-layer projection the kernel does not
hold, keeps the Python loop."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
from gemma4_checkpoints import WRITERS
from gemma4_gguf import write_gemma4_gguf
from helpers import make_engine, run_to_completion
from test_fused_model import GREEDY
from test_native_layers import CountingNativeAndPython

from nanoserve.model.gemma4_native import gemma4_module
from nanoserve.model.quant_linear import QuantizedWeight

needs_native = pytest.mark.skipif(gemma4_module() is None,
                                  reason="the gemma4_layers extension is unavailable")
VOCAB, WINDOW = 49152, 4  # the tiny checkpoints' (gemma4_checkpoints.py)
# each kind's config overrides: E2B-like with per-layer inputs a whole Q8_0 block wide, and
# with 8 (stored F16: no packed kernel takes it)
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "e2b": ("e2b", {"hidden_size_per_layer_input": 32}), "dense": ("dense", {}),
    "moe": ("moe", {}), "e2b-ple8": ("e2b", {})}


@pytest.fixture(scope="module")
def gemma4_gguf(tmp_path_factory: pytest.TempPathFactory,
                default_tokenizer: Any) -> Callable[[str], Path]:
    """kind (a key of KINDS) -> its tiny checkpoint as a Q8_0 GGUF file, made once."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            writer, overrides = KINDS[kind]
            folder = tmp_path_factory.mktemp(f"gemma4-native-{kind}")
            checkpoint = WRITERS[writer](folder / "hf", default_tokenizer, **overrides)
            made[kind] = write_gemma4_gguf(checkpoint, folder / f"{kind}.gguf",
                                           gguf.GGMLQuantizationType.Q8_0)
        return made[kind]

    return make


def step_prompts(seed: int = 5) -> dict[str, list[int]]:
    """Prompts of 1 to 90 tokens: in 24-token steps the long ones come in chunks beside the
    others' decodes."""
    rng = random.Random(seed)
    return {f"p{n}": [rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 3, 9, 26, 41, 90)}


@needs_native
@pytest.mark.parametrize(("kind", "kv_cache_dtype"),
                         [("e2b", "float32"), ("e2b", "float16"), ("e2b", "int8"),
                          ("dense", "float32"), ("dense", "int8")])
def test_the_gemma4_stack_equals_the_python_loop_bit_for_bit(
        kind: str, kv_cache_dtype: str, gemma4_gguf: Callable[[str], Path]) -> None:
    engine = make_engine(gemma4_gguf(kind), quantization="gguf", max_num_batched_tokens=24,
                         kv_cache_dtype=kv_cache_dtype)
    model = engine.runner.model
    layers = model.arch.gemma4
    assert layers is not None  # (each layer that owns a cache its own KV group)
    assert len(engine.kv_cache.group_windows) == len(layers.kv_layers) > 1
    assert model.features.has_windows and model.features.has_local_rope
    assert len(set(layers.head_dims)) == 2
    if kind == "e2b":  # KV-shared layers and packed per-layer projections
        assert layers.kv_sources == (0, 1, 2, 1, 1, 2)
        assert all(isinstance(w, QuantizedWeight) and w.is_packed
                   for layer in model.decoder_layers for w in (layer.ple_gate, layer.ple_proj))
    else:  # K = V global layers with fewer KV heads
        assert any(layers.k_eq_v) and len(set(layers.kv_heads)) == 2
    both = CountingNativeAndPython(engine.runner.plan)
    outputs = run_to_completion(engine, step_prompts(), GREEDY)
    assert all(len(ids) == GREEDY.max_tokens for ids in outputs.values())
    assert type(engine.runner.plan.layer_stack).__name__ == "Gemma4Stack"
    assert both.num_mixed_steps > 0
    assert 1 in both.num_tokens and any(1 < t < 24 for t in both.num_tokens)
    assert max(both.max_positions) > 20 * WINDOW
    assert both.identical and all(both.identical)


@needs_native
@pytest.mark.parametrize("kind", ["e2b", "dense"])
def test_enforce_eager_gives_the_same_greedy_tokens(
        kind: str, gemma4_gguf: Callable[[str], Path]) -> None:
    """The engine with the stack and under `--enforce-eager` (the Python loop): the same
    greedy tokens, batched and chunked."""
    from nanoserve.engine.build import build_engine_core
    from nanoserve.engine_args import EngineArgs

    outputs, stacks = {}, {}
    for eager in (False, True):
        engine = build_engine_core(EngineArgs(
            model=str(gemma4_gguf(kind)), device="cpu", quantization="gguf",
            kv_cache_memory_gb=0.0625, max_num_batched_tokens=32,
            enforce_eager=eager).to_config())
        outputs[eager] = run_to_completion(engine, step_prompts(9), GREEDY)
        stacks[eager] = engine.runner.plan.layer_stack
    assert stacks[True] is None and type(stacks[False]).__name__ == "Gemma4Stack"
    assert outputs[True] == outputs[False]


@needs_native
@pytest.mark.parametrize("kind", ["moe", "e2b-ple8"])
def test_experts_or_an_unpacked_projection_keep_the_python_loop(
        kind: str, gemma4_gguf: Callable[[str], Path]) -> None:
    """The MoE block is not in the stack; nor is a per-layer projection 8 columns wide (no
    whole Q8_0 block: stored F16): the fused Python loop runs."""
    engine = make_engine(gemma4_gguf(kind), quantization="gguf")
    outputs = run_to_completion(engine, {"a": [5, 17, 300, 4000]}, GREEDY)
    assert len(outputs["a"]) == GREEDY.max_tokens
    plan = engine.runner.plan
    assert plan.use_fused_ops and plan.layer_stack is None

"""hybrid_native.py's one-call stack of a Qwen3.5 hybrid against the Python layer loop over the
same fused kernels: every step run both ways from the same KV caches and DeltaNet states gives
the same final hidden states, caches and state pools (live slots and snapshots) bit for bit,
through decodes, batches of them, prefill chunks beside them and snapshots at block boundaries,
on the tiny hybrids of test_qwen35.py as Q8_0 GGUF files (tiled value heads) and quantized to
int8 at load (grouped ones, three key heads, conv 3); greedy and seeded tokens with logprobs,
chunked, batched, preempted and after prefix-cache hits, equal those of the Python loop; a
hybrid with experts keeps the Python loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import write_tiny_checkpoint
from gguf_writing import write_qwen35_gguf
from helpers import make_engine, run_one_request, run_to_completion, seeded_logprob_run
from test_qwen35 import GREEDY, random_ids, reference, tiny_qwen35_config

from nanoserve.model.hybrid_native import hybrid_module
from nanoserve.sampling_params import SamplingParams

needs_native = pytest.mark.skipif(hybrid_module() is None,
                                  reason="the hybrid_layers extension is unavailable")
# (kind, format, quantization): a Q8_0 file's packed blocks, and int8 at load
SOURCES = [("dense", "q8_0", "gguf"), ("wide", "safetensors", "int8")]


@pytest.fixture(scope="module")
def hybrid_source(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Any:
    """(kind, format) -> the path of test_qwen35.py's tiny checkpoint of that kind: its
    directory ("safetensors"), or the same as llama.cpp's converter writes it in Q8_0
    ("q8_0"); made once."""
    import gguf

    made: dict[tuple[str, str], str] = {}

    def make(kind: str, fmt: str) -> str:
        if (kind, fmt) not in made:
            folder = tmp_path_factory.mktemp(f"hybrid-native-{kind}")
            directory = write_tiny_checkpoint(folder / "hf", tiny_qwen35_config(kind),
                                              default_tokenizer, 35)
            made[(kind, fmt)] = str(directory)
            if fmt == "q8_0":
                model = reference(str(directory))
                made[(kind, fmt)] = str(write_qwen35_gguf(
                    model, model.config, folder / "model.gguf",
                    qtype=gguf.GGMLQuantizationType.Q8_0))
        return made[(kind, fmt)]

    return make


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaNs included: the pools are `torch.empty`, and slots no step has used yet
    may hold NaN patterns, which `torch.equal` calls unequal to themselves."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class HybridNativeAndPython:
    """Wraps a runner's forward plan: each step runs the Python loop, then the native stack
    from the caches and states the first started from; whether both left the same hidden
    states, KV caches and state pools. The second run goes on."""

    def __init__(self, plan: Any) -> None:
        self.plan, self.forward = plan, plan.forward
        plan.forward = self
        self.identical: list[bool] = []
        self.num_tokens: list[int] = []
        self.num_snapshots = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *args: Any,
                 **extra: Any) -> torch.Tensor:
        states = extra["states"]
        live = [t for pair in kv_caches for t in pair] + [states.conv_states, states.ssm_states]
        before = [t.clone() for t in live]
        self.plan.use_native_layers = False
        python = self.forward(input_ids, positions, kv_caches, *args, **extra)
        python_left = [t.clone() for t in live]
        for tensor, saved in zip(live, before, strict=True):
            tensor.copy_(saved)
        self.plan.use_native_layers = True
        native = self.forward(input_ids, positions, kv_caches, *args, **extra)
        assert type(self.plan.layer_stack).__name__ == "HybridStack"
        self.identical.append(same_bits(native, python) and all(
            same_bits(ours, theirs) for ours, theirs in zip(live, python_left, strict=True)))
        self.num_tokens.append(len(input_ids))
        self.num_snapshots += int((states.snapshots >= 0).sum())
        return native


@needs_native
@pytest.mark.parametrize(("kind", "fmt", "quantization"), SOURCES)
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
def test_every_step_equals_the_python_loop_bit_for_bit(
        kind: str, fmt: str, quantization: str, kv_cache_dtype: str, hybrid_source: Any) -> None:
    """Steps of one token, of several decodes and of prefill chunks beside them (a budget of
    24 tokens), with snapshots of the states at block boundaries."""
    path = hybrid_source(kind, fmt)
    engine = make_engine(path, quantization=quantization, max_num_batched_tokens=24,
                         kv_cache_dtype=kv_cache_dtype)
    both = HybridNativeAndPython(engine.runner.plan)
    prompts = {f"p{n}": random_ids(n, seed=300 + n) for n in (1, 5, 17, 40, 90)}
    outputs = run_to_completion(engine, prompts, GREEDY)
    assert all(len(ids) == GREEDY.max_tokens for ids in outputs.values())
    assert 1 in both.num_tokens and any(1 < t < 24 for t in both.num_tokens)
    assert 24 in both.num_tokens and both.num_snapshots > 0
    assert both.identical and all(both.identical)


def _outputs(path: str, quantization: str, is_native: bool, run: Any, **engine_args: Any
             ) -> Any:
    engine = make_engine(path, quantization=quantization, **engine_args)
    engine.runner.plan.use_native_layers = is_native
    got = run(engine)
    # (not `is None` for the Python loop's: a kernel-tuning step check at the engine's start,
    # from a cached schedule, may have built the stack before the loop was chosen)
    if is_native:
        assert type(engine.runner.plan.layer_stack).__name__ == "HybridStack"
    return got, engine


@needs_native
@pytest.mark.parametrize(("kind", "fmt", "quantization"), SOURCES)
def test_greedy_and_seeded_outputs_equal_the_python_loops(
        kind: str, fmt: str, quantization: str, hybrid_source: Any) -> None:
    """Alone, batched, in chunks of 7 and 48 tokens, preempted by a small cache: the same
    greedy tokens, and the same seeded tokens and logprobs, as the Python loop."""
    path = hybrid_source(kind, fmt)
    prompts = {f"p{n}": random_ids(n, seed=400 + n) for n in (1, 16, 37, 90, 150)}
    for budget, num_blocks in ((7, 40), (48, 17), (2048, None)):
        args = dict(max_num_batched_tokens=budget, num_blocks=num_blocks, max_model_len=256)
        greedy = [_outputs(path, quantization, is_native,
                           lambda e: run_to_completion(e, prompts, GREEDY), **args)
                  for is_native in (True, False)]
        assert greedy[0][0] == greedy[1][0], f"greedy tokens in chunks of {budget}"
        if num_blocks == 17:
            assert greedy[0][1].stats.num_preemptions > 0, "the small cache should preempt"
        seeded = [_outputs(path, quantization, is_native,
                           lambda e: seeded_logprob_run(e, prompts), **args)[0]
                  for is_native in (True, False)]
        assert seeded[0] == seeded[1], f"seeded tokens or logprobs in chunks of {budget}"


@needs_native
def test_prefix_hits_resume_the_states_as_the_python_loop(hybrid_source: Any) -> None:
    """A conversation sent turn by turn: each turn after the first resumes from the states
    snapshotted at a cached block (by the native stack, or by the Python loop), and gives the
    same tokens and logprobs both ways."""
    path = hybrid_source("dense", "q8_0")
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12,
                            ignore_eos=True, logprobs=3)

    def turns(engine: Any) -> list[Any]:
        prompt, got = random_ids(70, seed=500), []
        for turn in range(3):
            steps, cached = run_one_request(engine, prompt, params)
            assert (cached > 0) == (turn > 0), f"turn {turn}: {cached} cached tokens"
            got.append(steps)
            prompt = prompt + [ids[0] for ids, _ in steps] + random_ids(9, seed=501 + turn)
        return got

    native, _ = _outputs(path, "gguf", True, turns, max_num_batched_tokens=32)
    python, _ = _outputs(path, "gguf", False, turns, max_num_batched_tokens=32)
    assert native == python


@needs_native
def test_a_hybrid_with_experts_keeps_the_python_loop(hybrid_source: Any) -> None:
    path = hybrid_source("moe", "safetensors")
    engine = make_engine(path, quantization="int8")
    outputs = run_to_completion(engine, {"a": [5, 17, 300, 4000]}, GREEDY)
    assert len(outputs["a"]) == GREEDY.max_tokens
    plan = engine.runner.plan
    assert plan.use_fused_ops and plan.layer_stack is None

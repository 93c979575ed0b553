"""native_layers.py's one-call layer stack against the Python layer loop over the same fused
kernels: the same compiled kernels in the same order, so every step's hidden states and every
cache entry are equal bit for bit (not merely close), on the tiny Llama (tied head), Qwen2 (qkv
bias), Qwen3 (q/k norm) and Gemma 3 (sandwich norms, GELU-tanh, query scale, windows with their
own RoPE base and KV layer groups) checkpoints quantized to int8 at load or written as GGUF
files, through steps that mix decodes with chunked prefills; and the real Gemma 3 270M's
outputs and logprobs with the stack equal those under `--enforce-eager`."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from helpers import hf_model, run_to_completion
from test_fused_model import GREEDY, TwoPaths, prompts, small_engine
from test_gemma3 import TINY_WINDOW
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


# -- Gemma 3: sandwich norms, GELU-tanh gate, query scale, windows, local RoPE, KV groups -----
class CountingNativeAndPython(NativeAndPython):
    """NativeAndPython that also keeps each step's token count and largest position."""

    def __init__(self, plan: Any) -> None:
        super().__init__(plan)
        self.num_tokens: list[int] = []
        self.max_positions: list[int] = []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, *args: Any,
                 **groups: Any) -> torch.Tensor:
        self.num_tokens.append(len(input_ids))
        self.max_positions.append(int(positions.max()))
        return super().__call__(input_ids, positions, *args, **groups)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    """test_gemma3.py's tiny Gemma 3: six layers, windows of 16 on four of them with their own
    RoPE base (three KV layer groups), a query scale of 24 ** -0.5 over a head of 32."""
    import transformers
    from conftest import _spread_norm_weights
    from test_gemma3 import tiny_gemma3_config

    path = tmp_path_factory.mktemp("tiny-gemma3-native")
    torch.manual_seed(1234)
    model = transformers.Gemma3ForCausalLM(tiny_gemma3_config())
    _spread_norm_weights(model)
    model.save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


@needs_native
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "int8"])
def test_gemma3_native_stack_equals_the_python_loop_bit_for_bit(
        kv_cache_dtype: str, tiny_gemma3_dir: Path) -> None:
    """Steps of one token, of a few (the one-region forward) and of a prefill chunk (the
    dispatcher path), far past the window: every step's hidden states and caches equal the
    Python loop's bit for bit, each layer in its window, with its RoPE table and KV group."""
    from helpers import make_engine

    from nanoserve.model.layer_features import GELU_TANH

    engine = make_engine(tiny_gemma3_dir, quantization="int8", max_num_batched_tokens=48,
                         num_blocks=96, kv_cache_dtype=kv_cache_dtype)
    features = engine.runner.model.features
    assert features.has_sandwich_norms and features.activation == GELU_TANH
    assert features.q_scale != 1.0 and features.has_windows and features.has_local_rope
    assert engine.kv_cache.group_windows.count(0) == 1 and len(engine.kv_cache.group_windows) == 3
    both = CountingNativeAndPython(engine.runner.plan)
    run_to_completion(engine, prompts(2), GREEDY)
    assert both.num_mixed_steps > 0
    assert 1 in both.num_tokens and any(1 < t <= 15 for t in both.num_tokens)
    assert any(t > 15 for t in both.num_tokens) and max(both.max_positions) > 10 * 16
    assert both.identical and all(both.identical)


def write_gemma3_gguf(hf_dir: Path, out: Path) -> Path:
    """A tiny Gemma 3 checkpoint as llama.cpp's converter writes it: norms as 1 + w, q and k
    rows as they are (no permute), Q8_0 blocks (Q5_0 for attn_v and ffn_down, a file's mixed
    types: q, k and v then load as two row parts, a ConcatWeight)."""
    import gguf
    from gguf_writing import add_gemma3_tensors, add_shape, finish

    from nanoserve.bench.random_gguf import add_default_tokenizer
    from nanoserve.model.gguf_file import GGUFFile
    from nanoserve.model.loader import default_model_path

    model = hf_model(hf_dir)
    cfg = model.config
    meta = GGUFFile(default_model_path()).metadata
    writer = gguf.GGUFWriter(str(out), "gemma3")
    add_shape(writer, cfg, cfg.rope_parameters["full_attention"]["rope_theta"], cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    add_default_tokenizer(writer, meta, chat_template=False)
    add_gemma3_tensors(writer, model.state_dict(), lambda name: (
        GGMLQuantizationType.Q5_0 if name.split(".")[-2] in ("attn_v", "ffn_down")
        else GGMLQuantizationType.Q8_0))
    finish(writer)
    return out


@needs_native
def test_a_gemma3_gguf_file_runs_the_native_stack_as_the_python_loop(
        tmp_path: Path, default_tokenizer: Any) -> None:
    """A quantized Gemma 3 GGUF file (`--quantization gguf`: its own Q8_0 and Q5_0 blocks, q/k
    and v of two types; five windowed layers of six, each its own KV group): the native stack's
    steps equal the Python loop's bit for bit, past the window."""
    import transformers
    from conftest import _spread_norm_weights
    from helpers import make_engine
    from test_gemma3 import tiny_gemma3_config

    from nanoserve.model.arch import FULL, SLIDING

    config = tiny_gemma3_config()
    config.layer_types = [SLIDING] * 5 + [FULL]  # llama.cpp's gemma3 pattern
    torch.manual_seed(7)
    model = transformers.Gemma3ForCausalLM(config)
    _spread_norm_weights(model)
    model.save_pretrained(tmp_path / "hf")
    default_tokenizer.save_pretrained(tmp_path / "hf")
    path = write_gemma3_gguf(tmp_path / "hf", tmp_path / "gemma3.gguf")
    engine = make_engine(path, quantization="gguf", max_num_batched_tokens=48, num_blocks=160)
    layer = engine.runner.model.decoder_layers[0]
    assert layer.down_proj.ggml_type == GGMLQuantizationType.Q5_0
    assert [part.ggml_type for part in layer.qkv_proj.parts] == [GGMLQuantizationType.Q8_0,
                                                                 GGMLQuantizationType.Q5_0]
    assert engine.kv_cache.group_windows == (TINY_WINDOW,) * 5 + (0,)
    both = CountingNativeAndPython(engine.runner.plan)
    run_to_completion(engine, prompts(3), GREEDY)
    assert both.num_mixed_steps > 0 and max(both.max_positions) > 10 * TINY_WINDOW
    assert both.identical and all(both.identical)


@needs_native
@pytest.mark.slow
def test_gemma3_270m_outputs_equal_with_and_without_the_native_stack(
        gemma_270m_gguf: Path) -> None:
    """The real Gemma 3 270M (its own Q5_0, Q4_K, Q6_K and Q8_0 blocks): greedy and seeded
    requests with logprobs, prompts shorter and longer than its 512-token window, batched,
    give the same tokens and logprobs with the native stack as under `--enforce-eager`."""
    from nanoserve.engine.build import build_engine_core
    from nanoserve.engine_args import EngineArgs
    from nanoserve.sampling_params import SamplingParams

    prompts_by_kind = {"short": [2, 818, 5279, 529, 7001, 563],  # "<bos>The capital of France is"
                       "window": [2] + [(11 * i) % 30000 + 500 for i in range(530)]}
    requests = {f"{kind}-{name}": (ids, SamplingParams(
        temperature=0.0 if kind == "greedy" else 0.8, top_p=0.95, seed=7, max_tokens=8,
        ignore_eos=True, logprobs=2))
        for kind in ("greedy", "seeded") for name, ids in prompts_by_kind.items()}
    results, stacks = {}, {}
    for eager in (False, True):
        engine = build_engine_core(EngineArgs(
            model=str(gemma_270m_gguf), device="cpu", quantization="gguf",
            kv_cache_memory_gb=0.25, max_model_len=2048, max_num_batched_tokens=256,
            enforce_eager=eager).to_config())
        for rid, (ids, params) in requests.items():
            engine.add_request(rid, ids, params)
        got: dict[str, list[Any]] = {rid: [] for rid in requests}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += [(e.token_id, e.logprob, e.top_ids, e.top_logprobs)
                                        for e in out.new_logprobs or ()]
        results[eager] = got
        stacks[eager] = engine.runner.plan.layer_stack
    assert stacks[False] is not None and stacks[True] is None
    assert all(len(entries) == 8 for entries in results[False].values())
    assert results[False] == results[True]


@needs_native
def test_mistral_native_stack_attends_its_window_as_the_python_loop(
        tmp_path: Path, default_tokenizer: Any) -> None:
    """Mistral: every layer in a window of 24 keys (one KV group, one RoPE table), prompts far
    past it: the native stack's steps equal the Python loop's bit for bit."""
    from helpers import make_engine
    from test_sliding_window import write_tiny_mistral

    write_tiny_mistral(tmp_path, default_tokenizer)
    engine = make_engine(tmp_path, quantization="int8", max_num_batched_tokens=48,
                         num_blocks=96)
    assert engine.runner.model.features.windows == (24, 24)
    both = CountingNativeAndPython(engine.runner.plan)
    run_to_completion(engine, prompts(4), GREEDY)
    assert both.num_mixed_steps > 0 and max(both.max_positions) > 5 * 24
    assert both.identical and all(both.identical)

"""--mamba-ssm-cache-dtype (vLLM's flag): a hybrid model's recurrent DeltaNet states stored
bfloat16 or float16 (engine/state_pool.py, model/delta_net_ops.py). The pool's recurrent
states really are 16-bit (half the bytes, so twice the snapshots in the same memory; conv states
float32); the native layer stack and the Python layer loop still agree bit for bit; a prefix
hit, chunking and speculation stay exact relative to a 16-bit run itself; float32 ("auto") is
the default; a bad value is refused at start-up, naming the flag, the value and the choices.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from helpers import run_to_completion
from test_hybrid_native import HybridNativeAndPython, hybrid_source, needs_native
from test_qwen35 import GREEDY, qwen35_dir, random_ids
from test_spec_hybrid import (
    NUM_DRAFTS,
    PROMPTS,
    SEEDED,
    assert_drafts_kept_and_rejected,
    echo_qwen35,
    outputs,
)

from nanoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from nanoserve.engine.build import build_engine_core
from nanoserve.engine.core import EngineCore
from nanoserve.engine.state_pool import DEFAULT_SNAPSHOT_BYTES, num_snapshot_slots, state_bytes
from nanoserve.engine_args import EngineArgs
from nanoserve.sampling_params import SamplingParams
from nanoserve.speculative_config import SpeculativeConfig

__all__ = ["echo_qwen35", "hybrid_source", "qwen35_dir"]  # fixtures used here


def engine(path: Any, ssm_dtype: str, *, quantization: str = "int8", drafts: str | None = None,
           max_num_batched_tokens: int = 2048, **cache: Any) -> EngineCore:
    """A float32 engine on the CPU whose recurrent states are `ssm_dtype` (`cache`: more
    CacheConfig fields); int8 weights by default, whose matmuls' bits do not depend on a
    step's rows (so runs compare bit for bit); `drafts` a proposer's method."""
    speculative = None if drafts is None else SpeculativeConfig.parse(
        f'{{"method": "{drafts}", "num_speculative_tokens": {NUM_DRAFTS}}}')
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=str(path), device="cpu", dtype="float32",
                          quantization=quantization, kernel_tuning="off"),
        cache=CacheConfig(mamba_ssm_cache_dtype=ssm_dtype, **{"num_blocks": 256, **cache}),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                  draft_proposer=speculative,
                                  num_speculative_tokens=NUM_DRAFTS, speculative_max_rows=64)))


def test_flag_default_and_a_bad_value() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--mamba-ssm-cache-dtype", "bfloat16"]))
    assert args.to_config().cache.mamba_ssm_cache_dtype == "bfloat16"
    assert EngineArgs().to_config().cache.mamba_ssm_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--mamba-ssm-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match=r"--mamba-ssm-cache-dtype.*'fp8'.*'bfloat16'"):
        CacheConfig(mamba_ssm_cache_dtype="fp8")


@pytest.mark.parametrize("ssm_dtype", ["bfloat16", "float16"])
def test_the_pool_holds_16bit_recurrent_states(qwen35_dir: Any, ssm_dtype: str) -> None:
    """The recurrent states take half float32's bytes (the conv states stay float32), the
    default is float32, and the snapshots that fit the snapshot memory grow to match (here
    1.6x: this tiny model's conv states are large beside its recurrent ones; Qwen3.5-0.8B
    99 snapshots against 53)."""
    wide = engine(qwen35_dir("dense"), "auto")
    narrow = engine(qwen35_dir("dense"), ssm_dtype)
    pool, wide_pool = narrow.runner.state_pool, wide.runner.state_pool
    assert pool is not None and wide_pool is not None
    assert wide_pool.ssm.dtype == torch.float32 and pool.ssm.dtype == getattr(torch, ssm_dtype)
    assert pool.conv.dtype == wide_pool.conv.dtype == torch.float32
    assert pool.ssm.shape == wide_pool.ssm.shape and pool.num_slots == wide_pool.num_slots
    assert 2 * pool.ssm.nbytes == wide_pool.ssm.nbytes
    arch = narrow.runner.model.arch
    narrow_cache, wide_cache = narrow.config.cache, wide.config.cache
    per_slot = (pool.conv[0].nbytes + pool.ssm[0].nbytes, wide_pool.conv[0].nbytes
                + wide_pool.ssm[0].nbytes)
    assert (state_bytes(arch, narrow_cache), state_bytes(arch, wide_cache)) == per_slot
    unbounded = 1 << 40  # blocks: the snapshots' memory is the bound
    counts = [num_snapshot_slots(arch, unbounded, c) for c in (narrow_cache, wide_cache)]
    assert counts == [DEFAULT_SNAPSHOT_BYTES // size for size in per_slot]
    assert counts[0] > counts[1]
    # the run differs from float32's (the states are rounded), and is deterministic
    prompts = {"a": random_ids(40, seed=1)}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    got = [outputs(e, prompts, params)["a"] for e in (narrow, wide)]
    assert got[0][1] != got[1][1]
    assert outputs(engine(qwen35_dir("dense"), ssm_dtype), prompts, params)["a"] == got[0]


@needs_native
@pytest.mark.parametrize("ssm_dtype", ["bfloat16", "float16"])
def test_native_stack_equals_the_python_loop(hybrid_source: Any, ssm_dtype: str) -> None:
    """test_hybrid_native.py's step-by-step comparison with a 16-bit pool: decodes, batches,
    prefill chunks beside them and snapshots at block boundaries. The pool starts as NaNs (it is
    `torch.empty`, so a slot may hold any bits before its first use): the tokens are a clean
    pool's, so no slot's old bits reach a request."""
    prompts = {f"p{n}": random_ids(n, seed=300 + n) for n in (1, 5, 17, 40, 90)}
    clean = run_to_completion(engine(hybrid_source("dense", "q8_0"), ssm_dtype,
                                     quantization="gguf", max_num_batched_tokens=24),
                              prompts, GREEDY)
    core = engine(hybrid_source("dense", "q8_0"), ssm_dtype, quantization="gguf",
                  max_num_batched_tokens=24)
    pool = core.runner.state_pool
    assert pool is not None and pool.ssm.dtype == getattr(torch, ssm_dtype)
    pool.ssm.fill_(float("nan"))
    pool.conv.fill_(float("nan"))
    both = HybridNativeAndPython(core.runner.plan)
    got = run_to_completion(core, prompts, GREEDY)
    assert got == clean and all(len(ids) == GREEDY.max_tokens for ids in got.values())
    assert 24 in both.num_tokens and 1 in both.num_tokens and both.num_snapshots > 0
    assert both.identical and all(both.identical)


def test_a_prefix_hit_equals_a_cold_run_in_bfloat16(qwen35_dir: Any) -> None:
    """test_qwen35.py's conversation turn by turn: each later turn resumes from a bfloat16
    snapshot and gives the tokens and logprobs a bfloat16 engine without a prefix cache gives;
    chunks of 7 give them too."""
    path = qwen35_dir("dense")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    warm = engine(path, "bfloat16")
    cold = engine(path, "bfloat16", enable_prefix_caching=False)
    chunked = engine(path, "bfloat16", max_num_batched_tokens=7)
    history = random_ids(150, seed=300)
    for turn in range(3):
        tokens, logprobs, cached = warm_equals_cold(warm, cold, history, turn, params)
        if turn:
            assert cached >= len(history) - 40, f"turn {turn}: {cached} of {len(history)}"
        (chunked_tokens, chunked_logprobs, _), = outputs(chunked, {f"t{turn}": history},
                                                         params).values()
        assert (chunked_tokens, chunked_logprobs) == (tokens, logprobs), f"turn {turn}, chunked"
        history = history + tokens + random_ids(20, seed=301 + turn)


def warm_equals_cold(warm: EngineCore, cold: EngineCore, history: list[int], turn: int,
                     params: SamplingParams) -> tuple[list[int], list[Any], int]:
    """One turn on both engines: the warm one's tokens, logprobs and cached prompt tokens,
    its tokens and logprobs asserted equal to the cold one's."""
    (tokens, logprobs, cached), = outputs(warm, {f"t{turn}": history}, params).values()
    (cold_tokens, cold_logprobs, _), = outputs(cold, {f"t{turn}": history}, params).values()
    assert (tokens, logprobs) == (cold_tokens, cold_logprobs), f"turn {turn}"
    return tokens, logprobs, cached


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_changes_nothing_in_bfloat16(echo_qwen35: Path, method: str) -> None:
    """test_spec_hybrid.py's batched run, drafts on and off, both bfloat16."""
    off = outputs(engine(echo_qwen35, "bfloat16"), PROMPTS, SEEDED)
    on = engine(echo_qwen35, "bfloat16", drafts=method)
    assert outputs(on, PROMPTS, SEEDED) == off
    assert_drafts_kept_and_rejected(on)


def test_prefix_hits_inside_verify_chunks_in_bfloat16(echo_qwen35: Path) -> None:
    """A snapshot at every block, so boundaries fall inside verify chunks: each turn gives
    what a bfloat16 engine without drafts or a prefix cache gives."""
    warm = engine(echo_qwen35, "bfloat16", drafts="ngram", mamba_block_size=16)
    cold = engine(echo_qwen35, "bfloat16", enable_prefix_caching=False)
    history = random_ids(40, seed=300)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    for turn in range(3):
        tokens, _, cached = warm_equals_cold(warm, cold, history, turn, params)
        if turn:
            assert cached >= len(history) - 16 - 5, f"turn {turn}: {cached} of {len(history)}"
        history = history + tokens + random_ids(5, seed=301 + turn)
    assert_drafts_kept_and_rejected(warm)

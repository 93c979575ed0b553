"""SamplingParams: vLLM's fields, ranges and defaults; clear errors; generation_config defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nanoserve import LLM, SamplingParams


@pytest.mark.parametrize("field,value,message", [
    ("n", 0, "n must be an integer >= 1, got 0"),
    ("temperature", -0.5, "temperature must be >= 0"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_k", -2, "top_k must be -1, 0 (off) or a positive integer, got -2"),
    ("min_p", 1.2, "min_p must be in [0, 1], got 1.2"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2], got 2.5"),
    ("frequency_penalty", -3.0, "frequency_penalty must be in [-2, 2], got -3.0"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
    ("min_tokens", -1, "min_tokens must be >= 0, got -1"),
    ("logprobs", -1, "logprobs must be >= 0, got -1"),
    ("logprobs_mode", "fancy", "logprobs_mode must be 'raw' or 'processed', got 'fancy'"),
    ("thinking_token_budget", -4, "thinking_token_budget must be >= 0, got -4"),
    ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list"),
    ("stop", [""], "stop must be non-empty strings, got ''"),
    ("return_progress", "yes", "return_progress must be true or false, got 'yes'"),
])
def test_invalid_values_name_the_field_and_range(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert message in str(info.value)


def test_vllm_defaults_and_normalization() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == \
        (1, 1.0, 1.0, 0, 0.0, 16)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    # repeats mean nothing, and a hostile list of them would be scanned on every step
    assert SamplingParams(stop_token_ids=[7, 5, 7, 5] * 1000).stop_token_ids == [7, 5]
    assert SamplingParams(logit_bias={5: 250.0, 6: -400}).logit_bias == {5: 100.0, 6: -100.0}
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2)
    assert greedy.is_greedy and (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=20, max_tokens=10)


def test_token_ids_checked_against_the_vocabulary() -> None:
    with pytest.raises(ValueError, match=r"logit_bias must be token ids in \[0, 100\)"):
        SamplingParams(logit_bias={100: 1.0}).check_token_ids(100)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1]).check_token_ids(100)


def test_generation_config_gives_defaults(tiny_model_dir: Any, tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    llm = LLM(str(model), device="cpu", kv_cache_memory_gb=0.02)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)
    explicit = SamplingParams.from_generation_config({"temperature": 0.6}, temperature=0.2)
    assert explicit.temperature == 0.2
    assert SamplingParams.from_generation_config({"do_sample": False}).is_greedy

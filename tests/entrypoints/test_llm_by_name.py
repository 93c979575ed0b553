"""`LLM("org/repo")`: the offline engine fetches a name from a hub (served on loopback by the test,
tests/hub_server.py) before it starts, and computes what the same checkpoint by its path does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hub_server import checkpoint_repo_files, serve_hub

from nanoserve import LLM, SamplingParams

REPO = "org/tiny-qwen3"


def test_llm_by_name_equals_llm_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        tiny_model_dir: Callable[[str], Path]) -> None:
    checkpoint = tiny_model_dir("qwen3")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with serve_hub({REPO: checkpoint_repo_files(checkpoint)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("NANOSERVE_MODELS", str(tmp_path / "pulled"))
        by_name = LLM(REPO, device="cpu", kv_cache_memory_gb=0.05)
        assert hub.num_gets(REPO, "config.json") == 1
        from_name = by_name.generate(["Hello there"], greedy)[0].outputs[0].token_ids
    by_path = LLM(str(checkpoint), device="cpu", kv_cache_memory_gb=0.05)
    assert from_name == by_path.generate(["Hello there"], greedy)[0].outputs[0].token_ids

"""Sampling defaults for people (the chat page and `nanoserve chat`): the model's own, else the
tail-cutting preset; the API's defaults stay vLLM's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from nanoserve.entrypoints.serving.chat_defaults import PRESET, chat_defaults, describe
from nanoserve.sampling_params import SamplingParams


def test_a_model_without_settings_gets_the_preset() -> None:
    defaults = chat_defaults({"bos_token_id": 1, "eos_token_id": 2})
    assert defaults.source == "preset"
    assert (defaults.temperature, defaults.top_p, defaults.min_p) == (0.7, 0.95, 0.05)
    # the API keeps vLLM's: temperature 1, no cut
    assert (SamplingParams().temperature, SamplingParams().top_p) == (1.0, 1.0)


def test_a_model_with_a_temperature_gets_its_own_settings_and_no_other_cut() -> None:
    defaults = chat_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert defaults.source == "model"
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p) == (
        0.6, 0.95, 20, 0.0)


def test_do_sample_false_means_greedy() -> None:
    defaults = chat_defaults({"do_sample": False, "temperature": 0.9})
    assert (defaults.temperature, defaults.source) == (0.0, "model")


def test_a_model_value_without_a_temperature_goes_over_the_preset() -> None:
    defaults = chat_defaults({"repetition_penalty": 1.1})
    assert (defaults.source, defaults.repetition_penalty) == ("preset", 1.1)
    assert defaults.temperature == PRESET["temperature"]


@pytest.mark.parametrize(("config", "max_model_len", "expected"), [
    ({}, None, 1024), ({}, 256, 128), ({"max_new_tokens": 300}, 8192, 300)])
def test_max_tokens_leaves_room_for_the_conversation(config: dict[str, Any],
                                                     max_model_len: int | None,
                                                     expected: int) -> None:
    assert chat_defaults(config, max_model_len).max_tokens == expected


def test_describe_names_what_cuts() -> None:
    line = describe(chat_defaults({}).sampling(), "preset")
    assert line == ("sampling: temperature 0.7, top_p 0.95, min_p 0.05, max_tokens 1024 (from "
                    "the chat preset; flags change them)")


def nanoserve_chat(model: Path, *flags: str) -> str:
    done = subprocess.run([sys.executable, "-m", "nanoserve.entrypoints.cli", "chat", "--model",
                           str(model), "--max-tokens", "2", *flags], input="hi\n",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_cli_chat_starts_from_the_model_defaults_and_flags_win(tiny_model_dir: Any,
                                                               tmp_path: Path) -> None:
    plain, tuned = tmp_path / "model", tmp_path / "tuned"
    shutil.copytree(tiny_model_dir("llama"), plain)
    shutil.copytree(tiny_model_dir("llama"), tuned)
    config = json.loads((tuned / "generation_config.json").read_text())
    (tuned / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.3}))
    # both chats at once: each is seconds of start-up on one core
    with ThreadPoolExecutor(2) as pool:
        preset = pool.submit(nanoserve_chat, plain)
        out = pool.submit(nanoserve_chat, tuned, "--top-p", "0.5").result()
    assert "temperature 0.7, top_p 0.95, min_p 0.05, max_tokens 2 (from the chat preset" \
        in preset.result()
    assert "sampling: temperature 0.3, top_p 0.5, max_tokens 2 (from the model's defaults" in out

"""The `nanoserve` command line, run as a user would run it (a real subprocess)."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest


def nanoserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nanoserve.entrypoints.cli", *args],
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_prints_the_prompt_and_its_continuation(tiny_model_dir: Any) -> None:
    done = nanoserve("generate", "Once upon a time", "--model", str(tiny_model_dir("llama")),
                     "--max-tokens", "5", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Once upon a time") and len(done.stdout) > len("Once upon")


def test_chat_answers_each_line_until_eof(tiny_model_dir: Any) -> None:
    done = nanoserve("chat", "--model", str(tiny_model_dir("llama")), "--max-tokens", "3",
                     stdin="hello\nand again\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("> ") == 3  # two turns, then the prompt that meets EOF


def test_bad_model_path_is_a_clear_error() -> None:
    done = nanoserve("generate", "hi", "--model", "/no/such/dir")
    assert done.returncode == 1
    assert "model path '/no/such/dir' does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_help_lists_the_commands() -> None:
    done = nanoserve("--help")
    assert done.returncode == 0
    for command in ("generate", "chat", "bench"):
        assert command in done.stdout


@pytest.mark.parametrize("command", [["--help"], ["serve", "--help"],
                                     ["bench", "throughput", "--help"]])
def test_help_does_not_load_torch(command: list[str]) -> None:
    # torch takes seconds to import; building every command's flags needs none of it
    probe = ("import runpy, sys\n"
             f"sys.argv = ['nanoserve', *{command!r}]\n"
             "try:\n"
             "    runpy.run_module('nanoserve.entrypoints.cli', run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    assert e.code == 0, e.code\n"
             "print('torch loaded:', 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: nanoserve")
    assert done.stdout.splitlines()[-1] == "torch loaded: False"


def test_benchmarks_run_and_print_their_figures(tiny_model_dir: Any) -> None:
    model = str(tiny_model_dir("llama"))
    commands = {
        "throughput": ("throughput", "--model", model, "--num-prompts", "4", "--input-len",
                       "16", "--output-len", "4", "--skip-transformers"),
        "sampler": ("sampler", "--model", model, "--batch-sizes", "1,4", "--repeats", "1"),
        "detokenize": ("detokenize", "--model", model, "--lengths", "10,100"),
        # bench serve starts `nanoserve serve` itself, streams to it, and stops it
        "serve": ("serve", "--model", model, "--concurrency", "2", "--num-requests", "4",
                  "--input-len", "8", "--output-len", "4"),
    }
    # all four at once: each is seconds of start-up on one core (only their output is checked)
    with ThreadPoolExecutor(len(commands)) as pool:
        runs = dict(zip(commands, pool.map(lambda args: nanoserve("bench", *args),
                                           commands.values()), strict=True))
    done = runs["throughput"]
    assert done.returncode == 0, done.stderr
    assert "nanoserve tok/s" in done.stdout and "step / matmuls" in done.stdout
    assert "4 sequences, round 2: nanoserve" in done.stdout and "best of 2 rounds" in done.stdout
    done = runs["sampler"]
    assert done.returncode == 0, done.stderr
    assert "vs multinomial" in done.stdout
    for context_len in (64, 128, 256):
        assert f"{context_len}-token prompts" in done.stdout
    done = runs["detokenize"]
    assert done.returncode == 0, done.stderr
    assert "µs per token" in done.stdout and "naive / ours" in done.stdout
    done = runs["serve"]
    assert done.returncode == 0, done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.strip().startswith("2 "))
    assert row[1:3] == ["4", "0"]  # requests, failed

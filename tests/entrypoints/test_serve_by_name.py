"""`nanoserve serve NAME` against a hub served on loopback (tests/hub_server.py; `HF_ENDPOINT`
points the real huggingface_hub at it): every spelling of a name serves, and answers a chat
through the OpenAI SDK as the same file served by its path does.

- a GGUF repository by `org/repo` (its Q4_K_M file), by `hf.co/org/repo:Q8_0` (Ollama's
  spelling), and by `org/repo:Q4_1`, a model split in three parts;
- a safetensors checkpoint by `org/repo`, then again with `HF_HUB_OFFLINE=1` from the cache;
- what cannot be had stops `serve` before any process with one line and status 1: a missing
  quant (listing those offered), a gated repository without a token, offline without the file.

The servers start together (each start is seconds of mostly one core; the machine has two).
The references are the session's shared servers of the two files (shared_server.py: the default
model with no flags, test_embeddings.py's; the tiny one by its path, test_chaos.py's), so the
module starts only the servers by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hub_server import LocalHub, checkpoint_repo_files, gguf_repo_files, start_hub
from server_harness import RunningServer
from shared_server import shared_server

from nanoserve.model.model_path import default_model_path

pytestmark = [pytest.mark.slow, pytest.mark.server]

GGUF_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
TINY_REPO = "org/tiny-llama"
GATED_REPO = "org/gated-GGUF"
QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory,
        tiny_model_dir: Callable[[str], Path]) -> Iterator[LocalHub]:
    gguf = default_model_path()
    split_dir = tmp_path_factory.mktemp("split")
    hub = start_hub({
        GGUF_REPO: gguf_repo_files(gguf, "SmolLM2-135M-Instruct", split_dir=split_dir),
        TINY_REPO: checkpoint_repo_files(tiny_model_dir("llama")),
        GATED_REPO: gguf_repo_files(gguf, "gated", quants=("Q4_K_M",)),
    }, gated={GATED_REPO})
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def hub_env(hub: LocalHub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh hub cache and store of pulled models for the module, the hub on loopback, no
    token."""
    return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path_factory.mktemp("hf-home")),
            "NANOSERVE_MODELS": str(tmp_path_factory.mktemp("pulled")),
            "HF_HUB_DISABLE_TELEMETRY": "1", "HF_TOKEN": ""}


def answer(server: RunningServer, model: str) -> str:
    reply = server.client().chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    return reply.choices[0].message.content or ""


def serve_fails(env: dict[str, str], *args: str) -> str:
    """`nanoserve serve ARGS` that must fail before any process: its one line of error."""
    done = subprocess.run([sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 1, done.stderr
    *progress, line = done.stderr.strip().splitlines()  # "pulling manifest", then the error
    assert line.startswith("nanoserve serve: error: ") and len(progress) <= 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return line


def test_each_spelling_serves_what_its_path_serves(
        hub: LocalHub, hub_env: dict[str, str], tiny_model_dir: Callable[[str], Path],
        request: pytest.FixtureRequest) -> None:
    default, tiny = str(default_model_path()), str(tiny_model_dir("llama"))
    spellings = {  # the name given -> the file it must serve (served by itself: the reference)
        GGUF_REPO: default,
        f"hf.co/{GGUF_REPO}:Q8_0": default,
        f"{GGUF_REPO}:q4_1": default,  # the split one, quant in any case
        TINY_REPO: tiny,
    }
    by_name = {name: RunningServer(name, wait=False, env=hub_env) for name in spellings}
    try:
        # (started, where this module runs first, while the servers by name start)
        references = {default: shared_server(request), tiny: shared_server(request, tiny)}
        for server in by_name.values():
            server.wait_healthy()
        for name, path in spellings.items():
            served = [m.id for m in by_name[name].client().models.list().data]
            assert served == [name], served  # vLLM's rule: served as it was named
            reference = references[path]
            (reference_name,) = [m.id for m in reference.client().models.list().data]
            assert answer(by_name[name], name) == answer(reference, reference_name), name
        split_parts = {r.file for r in hub.requests if r.server == "cdn"
                       and r.file and "-of-00003" in r.file}
        assert len(split_parts) == 3, split_parts  # every part of the split, fetched
        assert "pulling manifest" in by_name[TINY_REPO].output_tail(200)  # the progress
    finally:
        for server in by_name.values():
            server.stop()
    # offline: the checkpoint from the cache alone, no request to the hub
    hub.clear_log()
    offline = RunningServer(TINY_REPO, env={**hub_env, "HF_HUB_OFFLINE": "1"})
    try:
        assert answer(offline, TINY_REPO)
        assert hub.requests == []
    finally:
        offline.stop()


def test_what_cannot_be_had_is_one_line_before_any_process(hub_env: dict[str, str]) -> None:
    line = serve_fails(hub_env, f"{GGUF_REPO}:Q5_K_M")
    assert "Q5_K_M" in line and "Q4_K_M" in line and "Q8_0" in line, line  # those offered
    line = serve_fails(hub_env, GATED_REPO)
    assert GATED_REPO in line and "token" in line.lower(), line
    line = serve_fails({**hub_env, "HF_HUB_OFFLINE": "1"}, "org/never-fetched")
    assert "org/never-fetched" in line and "offline" in line.lower(), line

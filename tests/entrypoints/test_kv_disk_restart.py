"""A server restarted over the same `--kv-cache-disk` folder answers a repeated long prompt with
most of it as `cached_tokens`, and with the tokens and logprobs of a server that computed it cold
(the default model's GGUF on its int8 kernels, whose bits do not depend on the batch); the same
after a `--models-dir` router's keep-alive unload and reload."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
from server_harness import RunningServer, wait_until

from nanoserve.model.loader import default_model_path

PROMPT = [random.Random(3).randrange(1000, 40000) for _ in range(700)]
CACHED = (len(PROMPT) - 1) // 16 * 16


def ask(server: RunningServer) -> tuple[Any, int]:
    answer = server.client().completions.create(
        model=server.client().models.list().data[0].id, prompt=PROMPT, max_tokens=8,
        temperature=0, logprobs=2)
    (choice,) = answer.choices
    details = answer.usage.prompt_tokens_details
    return ((choice.text, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs),
            details.cached_tokens if details else 0)


def test_a_restarted_server_finds_the_prompt_on_disk(tmp_path: Path) -> None:
    disk = ("--kv-cache-disk", str(tmp_path))
    first = RunningServer(*disk)
    cold, cached = ask(first)
    assert cached == 0
    assert first.stop() == 0  # its cached blocks written on the way out
    assert list(tmp_path.rglob("*.kv"))
    second = RunningServer(*disk)
    try:
        warm, cached = ask(second)
        assert cached == CACHED
        assert warm == cold
        assert second.metric("nanoserve:kv_disk_cache_hits_total") == CACHED // 16
    finally:
        assert second.stop() == 0


def test_a_routers_keep_alive_unload_and_reload_finds_it_too(tmp_path: Path) -> None:
    """`--models-dir` with `--keep-alive 2`: the model's server unloads when idle (its blocks
    written as it goes), its card says so, and the next request loads it again and finds the
    prompt on disk."""
    models = tmp_path / "models"
    models.mkdir()
    (models / default_model_path().name).symlink_to(default_model_path())
    router = RunningServer("--models-dir", str(models), "--keep-alive", "2",
                           "--kv-cache-disk", str(tmp_path / "kv"))
    try:
        cold, cached = ask(router)
        assert cached == 0
        wait_until(lambda: _states(router) == {"unloaded"}, "the idle model to unload",
                   timeout=60)
        # the router tells the model is warm on disk (llama-server's `status`, extended)
        (card,) = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
        assert card["status"]["kv_disk"]["files"] >= CACHED // 16, card
        warm, cached = ask(router)
        assert cached == CACHED
        assert warm == cold
    finally:
        assert router.stop() == 0


def _states(server: RunningServer) -> set[str]:
    body = httpx.get(server.url + "/v1/models", timeout=10).json()
    return {card["status"]["value"] for card in body["data"]}

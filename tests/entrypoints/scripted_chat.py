"""What the chat-format tests share (Gemma 4's, harmony's): a server on a tiny random model
whose outputs scripted_output.py's logits processor writes, and the `extra_args` that script a
given text in the model's own ids (each format token of the text one id, the text ending in a
stop id)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from server_harness import RunningServer

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def scripted_server(model: Path, *args: str, processor: str = "ScriptedOutput",
                    env: Mapping[str, str] | None = None) -> Iterator[RunningServer]:
    """`nanoserve serve model *args` with scripted_output.py's `processor` (`env` set for it),
    healthy, then stopped (exit code 0 checked)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("PYTHONPATH", str(HERE))  # where scripted_output lives
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        server = RunningServer(str(model), *args, "--logits-processors",
                               f"scripted_output:{processor}", wait=False)
    try:
        server.wait_healthy()
        yield server
    finally:
        exit_code = server.stop()
    assert exit_code == 0


def script_ids(encode: Callable[[str], list[int]], text: str, format_ids: Mapping[str, int],
               stop_ids: tuple[int, ...]) -> list[int]:
    """`text` in the model's ids, checked: each format token one id, the last a stop id."""
    ids = encode(text)
    for tag, tag_id in format_ids.items():
        assert ids.count(tag_id) == text.count(tag), tag
    assert ids[-1] in stop_ids
    return ids


def scripted(ids: list[int]) -> dict[str, Any]:
    """The `extra_args` (an SDK's `extra_body`) that make the model write `ids`."""
    return {"extra_args": {"scripted_token_ids": ids}}

"""A server that cannot start says why in one line on stderr and exits 1, with no traceback
(serving/engine_start.py, engine/start_failure.py); the traceback shows at `--log-level debug`.
A stop signal while the model loads ends every process at once.

The failures that need the engine core (a truncated GGUF, an unsupported architecture, a KV
cache larger than the memory, and one at debug) are started together: each is seconds of
importing torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from process_tree import still_running, tree
from server_harness import free_port, wait_until

from nanoserve.model.loader import default_model_path

pytestmark = pytest.mark.server


def serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--port",
         str(free_port()), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def failed(proc: subprocess.Popen[str]) -> str:
    """The one line a failed start printed on stderr (asserting it is one, with status 1)."""
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, (proc.returncode, out, err)
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("nanoserve serve: error: "), lines[0]
    return lines[0]


def truncated_gguf(folder: Path) -> Path:
    """The default model's file cut short, as an interrupted download leaves it."""
    path = folder / "cut-short.gguf"
    if path.exists():
        return path
    with open(default_model_path(), "rb") as whole, open(path, "wb") as part:
        part.write(whole.read(30_000_000))
    return path


def unsupported_checkpoint(folder: Path, tokenizer: Any) -> Path:
    """A real transformers checkpoint of an architecture nanoserve does not run (GPT-2)."""
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer),
                                     bos_token_id=tokenizer.bos_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
    path = folder / "gpt2-tiny"
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_missing_model_or_a_folder_without_one_is_one_line(tmp_path: Path) -> None:
    line = failed(serve(str(tmp_path / "no-such-model.gguf")))
    assert "no-such-model.gguf' does not exist" in line
    (tmp_path / "empty").mkdir()
    line = failed(serve(str(tmp_path / "empty")))
    assert "has no config.json" in line


def test_what_the_engine_cannot_load_is_one_line(tmp_path: Path,
                                                 default_tokenizer: Any) -> None:
    runs = {"truncated": serve(str(truncated_gguf(tmp_path))),
            "unsupported": serve(str(unsupported_checkpoint(tmp_path, default_tokenizer))),
            "memory": serve("--kv-cache-memory", "100000")}
    debug = serve(str(truncated_gguf(tmp_path)), "--log-level", "debug")
    lines = {name: failed(proc) for name, proc in runs.items()}
    assert "is truncated or damaged" in lines["truncated"]
    assert "fetch it again" in lines["truncated"]
    assert "unsupported architecture 'GPT2LMHeadModel'" in lines["unsupported"]
    assert "nanoserve runs model types" in lines["unsupported"]
    assert "not enough memory for the KV cache" in lines["memory"]
    assert "lower --kv-cache-memory" in lines["memory"]
    _, err = debug.communicate(timeout=240)  # the traceback behind the line, at debug
    assert debug.returncode == 1
    assert "Traceback" in err and "is truncated or damaged" in err


def test_a_stop_while_the_model_loads_ends_every_process(tmp_path: Path) -> None:
    proc = serve()
    wait_until(lambda: len(tree(proc.pid)) >= 2, "the engine core to start", timeout=30)
    pids = tree(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)  # not waiting for the load to finish
    wait_until(lambda: not still_running(pids), "every process to exit", timeout=30)
    assert proc.wait(timeout=10) == 0
    assert "Traceback" not in proc.communicate()[1]

"""`nanoserve serve --tensor-parallel-size 2`: a worker killed under load.

The tiny Llama at TP 2 on the exact path; rank 1 is a child of the engine core process. (A
server start at TP 2 is ~20 s of this 2-core machine, so SIGTERM's clean stop of every rank
is not a test of its own here.)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from server_harness import process_gone, wait_until
from test_server_lifecycle import Starter, Streams, child_pids, engine_pid, start_server

pytestmark = pytest.mark.distributed
__all__ = ["start_server"]  # the fixture, shared with test_server_lifecycle


def tp_worker_pid(server: Any) -> int:
    """Rank 1: the engine core's child that runs nanoserve.engine.tp_worker."""
    for pid in child_pids(engine_pid(server)):
        if b"nanoserve.engine.tp_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("tensor-parallel worker not found")


def test_a_worker_killed_under_8_streams_fails_every_client_and_the_server(
        tiny_model_dir: Any, start_server: Starter) -> None:
    """Every stream ends with an error within 5 s of the kill, /health says 503 (or the
    server has gone), the server exits non-zero, and the engine core is gone too."""
    before = set(Path("/tmp").glob("nanoserve-tp-*"))
    server = start_server(str(tiny_model_dir("llama")), "--tensor-parallel-size", "2",
                          "--quantization", "none", "--max-model-len", "1024")
    engine = engine_pid(server)
    worker = tp_worker_pid(server)
    mine = set(Path("/tmp").glob("nanoserve-tp-*")) - before  # this server's step socket
    assert len(mine) == 1
    streams = Streams(server, 8)
    streams.wait_all_started()
    assert all(not errors for errors in streams.errors), "a stream failed before the kill"
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    streams.assert_all_told(server, killed_at, within=5.0)
    wait_until(lambda: process_gone(engine), "the engine core to exit", timeout=10)
    assert not any(d.exists() for d in mine)

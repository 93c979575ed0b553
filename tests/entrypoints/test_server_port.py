"""A busy port is an error: a second `nanoserve serve` on a taken address exits non-zero at once,
naming the address, while the first keeps serving; `--api-server-count 2` still shares one port
between its own processes (one inherited socket), and still refuses a second server."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import RunningServer
from shared_server import shared_server

pytestmark = pytest.mark.server


def second_server(model: str, port: int) -> tuple[int, str, float]:
    """`nanoserve serve` on a port that is taken: its exit status, stderr and run time."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", model,
                           "--port", str(port)], capture_output=True, text=True, timeout=120)
    return done.returncode, done.stderr, time.monotonic() - started


def completion(server: RunningServer, prompt: str = "hello") -> str:
    response = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 3,
                                               "temperature": 0})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def assert_refused(model: str, server: RunningServer) -> None:
    before = completion(server)
    status, stderr, seconds = second_server(model, server.port)
    assert status != 0
    assert f"127.0.0.1:{server.port}: address already in use" in stderr
    # the holder is named: the first server's launcher (or one of its processes)
    assert re.search(r"held by pid \d+", stderr), stderr
    assert len(stderr.strip().splitlines()) == 1, stderr  # one line, no traceback
    assert seconds < 60  # it never loads the model (a load alone takes longer on CI)
    assert server.proc.poll() is None
    assert completion(server) == before  # the first one still answers, the same


def test_a_second_server_on_a_busy_port_exits_with_one_line(request: pytest.FixtureRequest,
                                                          tiny_model_dir: Any) -> None:
    model = str(tiny_model_dir("llama"))
    assert_refused(model, shared_server(request, model))  # test_chaos.py's; exits 0 at the end


def test_api_server_count_2_shares_its_port_and_still_refuses_a_second_server(
        tiny_model_dir: Any, tmp_path: Path) -> None:
    model = str(tiny_model_dir("llama"))
    log = tmp_path / "server.log"
    server = RunningServer(model, "--api-server-count", "2", "--log-level", "info", log=log)
    try:
        answered_by: set[str] = set()
        for _ in range(10):  # which process accepts is the kernel's pick: ask until both did
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: completion(server, f"hi {i}"), range(8)))
            answered_by = set(re.findall(r" (api-\d): request ", log.read_text()))
            if len(answered_by) == 2:
                break
        assert answered_by == {"api-0", "api-1"}
        assert_refused(model, server)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    finally:
        assert server.stop() == 0
